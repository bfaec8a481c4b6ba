"""Loss by position: log-spaced buckets counted within each document, checked against a single-device numpy reference;
the buckets' token-weighted mean is the overall loss; the same numbers on sp 1, 4 and 8 (and a ring, the tiled loss)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from ulysses_jax.data.documents import DataConfig
from ulysses_jax.data.pipeline import eval_batches
from ulysses_jax.evaluation.position import PositionLoss, bucket_edges, loss_by_position
from ulysses_jax.evaluation.token_scores import make_token_step
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.train.devices import MeshConfig, build_mesh
from ulysses_jax.train.eval_loss import evaluate_loss
from ulysses_jax.train.step import make_eval_step, state_shardings

SEQ, BATCH, BATCHES = 256, 2, 2


def test_bucket_edges():
    assert bucket_edges(256).tolist() == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_edges(300).tolist() == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert bucket_edges(1).tolist() == [0, 1]


def test_each_token_lands_in_the_bucket_of_its_position(seed):
    """Each token's loss is a code of its position, so every bucket's mean is known: the mean of the codes of the
    positions in [start, end) that were fed, and its token count theirs; a bucketing that put tokens anywhere else
    (every token in bucket 0, off by one edge) changes both. Masked tokens (label -1) count nowhere."""
    rng = np.random.default_rng(seed)
    acc = PositionLoss(64)
    fed = []
    for _ in range(3):
        positions = rng.integers(0, 64, (4, 64))
        labels = np.where(rng.random((4, 64)) < 0.2, -1, 1)
        loss = (1000.0 + positions).astype(np.float32)  # the loss names the position
        acc.add(loss, labels, positions)
        fed.append(positions[labels >= 0])
    fed = np.concatenate(fed)
    res = acc.result()
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32),
                                                                (32, 64)]
    for b in res["buckets"]:
        inside = fed[(fed >= b["start"]) & (fed < b["end"])]
        assert b["tokens"] == inside.size
        if inside.size:
            assert b["loss"] == pytest.approx(1000.0 + inside.mean(), rel=1e-12)
        else:
            assert b["loss"] is None
    assert res["tokens"] == fed.size and res["loss"] == pytest.approx(1000.0 + fed.mean(), rel=1e-12)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 64\)"):
        acc.add(loss, labels, positions + 64)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    words = ["alpha", "beta", "gamma", "delta", "ulysses", "token", "device", "shard"]
    rng = np.random.default_rng(0)
    corpus = tmp_path_factory.mktemp("pos") / "eval.jsonl"
    # documents shorter and longer than a row: packed rows hold several, long ones are cut into pieces
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(n)))}) + "\n"
                              for n in rng.integers(3, 90, 24)))
    data = DataConfig(paths=(str(corpus),), eval_paths=(str(corpus),), eval_fraction=0.0)
    model = ModelConfig.from_preset("tiny", num_layers=2, vocab_size=256, attention_impl="xla")
    return data, model


def _params(model_cfg, mesh):
    graphdef, params = nnx.split(Transformer(model_cfg, mesh=mesh, rngs=nnx.Rngs(3)))
    return graphdef, params


def _by_position(model_cfg, data, mesh_cfg, devices=None):
    mesh = build_mesh(mesh_cfg, model_cfg, SEQ, devices=devices)
    graphdef, params = _params(model_cfg, mesh)
    token_step = make_token_step(graphdef, mesh, state_shardings(params))
    res = loss_by_position(token_step, params, data, mesh, seq_len=SEQ, batch_size=BATCH, max_batches=BATCHES)
    plain = evaluate_loss(make_eval_step(graphdef, mesh, state_shardings(params)), params, data, mesh, seq_len=SEQ,
                          batch_size=BATCH, max_batches=BATCHES)
    return res, plain


def _reference(model_cfg, data):
    """Per-token losses from the full logits on one device, in float64 numpy; the position of a token counted from its
    segment's first token (segment ids only, not the batch's positions)."""
    mesh = build_mesh(MeshConfig(sp=1), model_cfg, SEQ, devices=jax.devices()[:1])
    model = Transformer(model_cfg, mesh=mesh, rngs=nnx.Rngs(3))
    edges = bucket_edges(SEQ)
    sums, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1, np.int64)
    for b in eval_batches(data, seq_len=SEQ, global_batch=BATCH, max_batches=BATCHES):
        logits = np.asarray(model(b["tokens"], b["positions"], b["segment_ids"]), np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        for r in range(BATCH):
            seg = b["segment_ids"][r]
            for t in range(SEQ):
                label = b["labels"][r, t]
                if label < 0:
                    continue
                p = t - np.flatnonzero(seg[: t + 1] != seg[t]).max(initial=-1) - 1  # tokens of its document before t
                k = np.searchsorted(edges, p, side="right") - 1
                sums[k] += lse[r, t] - logits[r, t, label]
                counts[k] += 1
    return sums, counts


@pytest.fixture(scope="module")
def base(setting):
    data, model_cfg = setting
    return _by_position(model_cfg, data, MeshConfig(fsdp=2, sp=4))


def test_by_position_equals_reference_and_plain_eval(setting, base):
    data, model_cfg = setting
    res, plain = base
    sums, counts = _reference(model_cfg, data)
    got = res["buckets"]
    assert [b["tokens"] for b in got] == counts.tolist()
    assert sum(1 for b in got if b["tokens"]) >= 8  # positions up to the last bucket are present
    for b, s, c in zip(got, sums, counts):
        if c:
            assert b["loss"] == pytest.approx(s / c, rel=2e-5)
    assert res["tokens"] == plain["tokens"] and res["batches"] == plain["batches"]
    assert res["loss"] == pytest.approx(plain["loss"], rel=1e-5)  # float32 sums on the device vs float64 here
    weighted = sum(b["tokens"] * b["loss"] for b in got if b["tokens"]) / sum(b["tokens"] for b in got)
    assert weighted == pytest.approx(res["loss"], rel=1e-13, abs=0)  # exact to float64 rounding


@pytest.mark.parametrize("mesh_cfg,devices,compute", [
    (MeshConfig(sp=1), 1, {}),
    (MeshConfig(sp=8), 8, {}),
    pytest.param(MeshConfig(ring=2, sp=4), 8, {}, marks=pytest.mark.slow),
    pytest.param(MeshConfig(fsdp=2, sp=4), 8, {"loss_chunk": 32}, marks=pytest.mark.slow),
], ids=["sp1", "sp8", "ring2xsp4", "sp4-tiled-loss"])
def test_same_numbers_on_any_mesh(setting, base, mesh_cfg, devices, compute):
    data, model_cfg = setting
    base = base[0]
    res, _ = _by_position(dataclasses.replace(model_cfg, **compute), data, mesh_cfg, devices=jax.devices()[:devices])
    assert [b["tokens"] for b in res["buckets"]] == [b["tokens"] for b in base["buckets"]]
    for a, b in zip(res["buckets"], base["buckets"]):
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert res["loss"] == pytest.approx(base["loss"], rel=1e-6)
