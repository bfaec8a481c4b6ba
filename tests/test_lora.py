"""LoRA (model/lora.py, interop/peft.py): adapters born sharded and zero, only they train (no base gradient, no base
optimizer state), the same loss and gradients on any mesh and with the memory tools; a tiny Llama folder fine-tuned with
--lora-rank exports a peft adapter that peft loads with no missing or unexpected key and the logits of `export --merge`
reloaded in transformers; resume is exact; bad input is one line, exit 2, nothing written."""

import contextlib
import dataclasses
import io
import json
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_cli_hf as hf_helpers  # the tiny Hugging Face folder and the CLI helpers (a module: not collected twice)
from flax import nnx
from test_step import CFG, random_batch

from ulysses_jax import make_mesh
from ulysses_jax.cli import main
from ulysses_jax.model import lora
from ulysses_jax.model.lora_config import LoraConfig, projection_sides
from ulysses_jax.model.transformer import Transformer
from ulysses_jax.train.step import OptimConfig, _loss_sums, init_state, make_optimizer, make_train_step

LCFG = dataclasses.replace(CFG, attention_impl="xla", lora=LoraConfig(rank=4))


def _state(cfg, mesh, lr=1e-2):
    tx = make_optimizer(OptimConfig(lr=lr, warmup_steps=0), 10)
    graphdef, state = init_state(cfg, mesh, tx, seed=0)
    return graphdef, state, tx


def test_adapters_start_at_the_base_and_only_they_train():
    mesh = make_mesh(fsdp=2, sp=4)
    base = Transformer(dataclasses.replace(LCFG, lora=None), mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, state, tx = _state(LCFG, mesh)
    model = nnx.merge(graphdef, state["params"])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 32)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(base(tokens)))  # B = 0: the base exactly
    adapters, frozen = lora.split(state["params"])
    a = adapters["blocks"]["lora"]["w_q_a"].get_value()
    assert a.shape == (1, CFG.hidden, 4) and a.sharding.spec[1] == ("fsdp", "ring", "sp")  # split like W's embed
    assert not np.any(np.asarray(adapters["blocks"]["lora"]["w_q_b"].get_value()))
    n_adapters = len(jax.tree.leaves(adapters))
    assert n_adapters == 14  # A and B of q, k, v, o, gate, up, down
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
    assert len(moments) == 2 * n_adapters  # AdamW's mu and nu of the adapters alone: nothing for the base
    before = jax.tree.map(np.asarray, state["params"])
    step = make_train_step(graphdef, tx, lambda s: 1e-2, mesh, jax.tree.map(lambda x: x.sharding, state))
    for i in range(2):
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in random_batch(i, 2).items()})
    assert np.isfinite(float(metrics["loss"]))
    after_adapters, after_frozen = lora.split(jax.tree.map(np.asarray, state["params"]))
    before_adapters, before_frozen = lora.split(before)
    for x, y in zip(jax.tree.leaves(before_frozen), jax.tree.leaves(after_frozen)):
        np.testing.assert_array_equal(x, y)  # the base: bit for bit
    changed = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before_adapters),
                                                         jax.tree.leaves(after_adapters))]
    assert all(changed), changed


def _random_adapters(cfg, mesh, b_scale=0.05):
    """``(graphdef, adapters, frozen)`` of a fresh model whose adapters are moved off their start (B nonzero unless
    ``b_scale`` is 0), the same values on any mesh."""
    graphdef, params = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    adapters, frozen = lora.split(params)
    leaves, treedef = jax.tree.flatten_with_path(adapters)
    leaves = [x + (b_scale if "_b'" in jax.tree_util.keystr(path) else 0.05)
              * jax.random.normal(jax.random.key(i), x.shape, x.dtype) for i, (path, x) in enumerate(leaves)]
    return graphdef, jax.tree.unflatten(treedef, leaves), frozen


def _loss_and_grads(cfg, mesh, batch, key=None, b_scale=0.05):
    """The mean loss and the adapters' gradients with random adapters (``_random_adapters``); ``key``: dropout's."""
    graphdef, adapters, frozen = _random_adapters(cfg, mesh, b_scale)

    def loss(t, key):
        objective, sums = _loss_sums(graphdef, lora.join(t, frozen), batch, key)
        return objective / sums["count"]

    value, grads = jax.jit(jax.value_and_grad(loss))(adapters, key)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("tools", [pytest.param({}, marks=pytest.mark.slow), dict(remat="full", mlp_chunk=4)],
                         ids=["plain", "remat-tiled-mlp"])
def test_loss_and_gradients_are_those_of_the_merged_weights_written_out(tools):
    """The reference: the model without adapters whose targeted weights are W + scale A B, formed here in float64 and
    differentiated through; the adapters' terms beside the frozen products (lora.low_rank) must give its loss and
    A's and B's gradients."""
    mesh = make_mesh(fsdp=2, sp=4)
    cfg = dataclasses.replace(LCFG, **tools)
    batch = {k: jnp.asarray(v) for k, v in random_batch(5, 2).items()}
    graphdef, adapters, frozen = _random_adapters(cfg, mesh)
    base_graphdef, base_params = nnx.split(Transformer(dataclasses.replace(cfg, lora=None), mesh=mesh,
                                                       rngs=nnx.Rngs(0)))
    scale = cfg.lora.scale

    def reference(pure_adapters):
        pure = nnx.to_pure_dict(frozen)
        for t in cfg.lora.targets:
            module, attr, n_in = lora.WEIGHTS[t]
            a, b = (pure_adapters["blocks"]["lora"][f"w_{t}_{side}"] for side in "ab")
            w = pure["blocks"][module][attr]
            ab = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0],
                            b.shape[1], -1), precision="highest")
            pure["blocks"][module][attr] = w + scale * ab.reshape(w.shape)
        params = jax.tree.map(lambda x: x, base_params)
        nnx.replace_by_pure_dict(params, pure)
        objective, sums = _loss_sums(base_graphdef, params, batch)
        return objective / sums["count"]

    def ours(t):
        objective, sums = _loss_sums(graphdef, lora.join(t, frozen), batch)
        return objective / sums["count"]

    want, want_grads = jax.jit(jax.value_and_grad(reference))(nnx.to_pure_dict(adapters))
    got, got_grads = jax.jit(jax.value_and_grad(ours))(adapters)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    got_grads = nnx.to_pure_dict(got_grads)["blocks"]["lora"]
    for name, r in want_grads["blocks"]["lora"].items():
        assert np.abs(r).max() > 0, name
        np.testing.assert_allclose(got_grads[name], r, atol=2e-5 * np.abs(r).max(), rtol=1e-3, err_msg=name)


def test_dropout_masks_depend_on_the_token_alone():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 3, 32)), jnp.float32) + 5.0
    ids, key = lora.token_ids((2, 64)), jax.random.key(7)
    y = np.asarray(lora.dropout(x, 0.25, key, ids))
    kept = y != 0
    assert 0.22 < 1 - kept.mean() < 0.28  # about a quarter dropped
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)  # the rest scaled up
    part = np.asarray(lora.dropout(x[1:, 16:40], 0.25, key, ids[1:, 16:40]))  # a device's or a chunk's share
    np.testing.assert_array_equal(part, y[1:, 16:40])
    assert not np.array_equal(np.asarray(lora.dropout(x, 0.25, jax.random.key(8), ids)), y)


def test_dropout_drops_the_adapters_inputs_alone_and_is_the_same_on_any_mesh():
    cfg = dataclasses.replace(LCFG, lora=LoraConfig(rank=4, dropout=0.5))
    batch = {k: jnp.asarray(v) for k, v in random_batch(4, 2).items()}
    mesh, one = make_mesh(fsdp=2, sp=4), make_mesh(fsdp=2, sp=1, devices=jax.devices()[:2])
    key = jax.random.key(11)
    # B = 0: the adapters add nothing, so dropout on their inputs leaves the loss alone; B's gradients see the drop
    plain, plain_g = _loss_and_grads(cfg, mesh, batch, b_scale=0.0)
    dropped, dropped_g = _loss_and_grads(cfg, mesh, batch, key, b_scale=0.0)
    assert dropped == plain
    assert not np.allclose(dropped_g[1], plain_g[1])  # w_down_b (leaves in name order: down_a, down_b, ...)
    # B nonzero: the loss moves with the key, is the same for the same key on sp 1, sp 4 and with the tiled MLP
    loss, grads = _loss_and_grads(cfg, mesh, batch, key)
    assert loss != _loss_and_grads(cfg, mesh, batch)[0]
    assert loss != _loss_and_grads(cfg, mesh, batch, jax.random.key(12))[0]
    for mesh_, tools in ((one, {}), (mesh, dict(remat="full", mlp_chunk=4, loss_chunk=4))):
        other, other_grads = _loss_and_grads(dataclasses.replace(cfg, **tools), mesh_, batch, key)
        assert other == pytest.approx(loss, rel=1e-5)
        for g, r in zip(other_grads, grads):
            np.testing.assert_allclose(g, r, atol=2e-5 * np.abs(r).max(), rtol=1e-3)


TOOLS = dict(remat="full", mlp_chunk=4, attn_chunk=4, loss_chunk=4)


@pytest.mark.parametrize("mesh_kw, tools", [
    pytest.param(dict(fsdp=2, sp=4), {}, marks=pytest.mark.slow),
    (dict(fsdp=2, sp=4), TOOLS),
    pytest.param(dict(fsdp=2, ring=2, sp=2), dict(remat="full", mlp_chunk=4, loss_chunk=4), marks=pytest.mark.slow),
], ids=["sp4", "sp4-remat-tiled", "ring2xsp2-remat-tiled"])
def test_same_loss_and_adapter_gradients_on_any_mesh_and_with_the_memory_tools(mesh_kw, tools):
    """sp 4 (and a ring) against sp 1 on two devices, plain and with remat and the tiled loss, MLP and attention."""
    batch = {k: jnp.asarray(v) for k, v in random_batch(3, 2).items()}
    ref_loss, ref_grads = _loss_and_grads(LCFG, make_mesh(fsdp=2, sp=1, devices=jax.devices()[:2]), batch)
    loss, grads = _loss_and_grads(dataclasses.replace(LCFG, **tools), make_mesh(**mesh_kw), batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for g, r in zip(grads, ref_grads):
        assert np.abs(r).max() > 0
        np.testing.assert_allclose(g, r, atol=2e-5 * np.abs(r).max(), rtol=1e-3)


def test_save_matmuls_keeps_the_base_products_and_recomputes_the_adapters_full_width_terms():
    """``--remat save_matmuls`` keeps every matmul's output; an adapter's full-width term (``x A`` times ``B``,
    ``lora._widen``) is recomputed from its rank-r input instead, else it is kept beside its base product (float32:
    Llama-3.1-8B LoRA at 32K needed 267 GiB with that policy on a compile-only H200, 114 GiB without). The loss and
    gradients are those of the model without remat."""
    cfg = dataclasses.replace(LCFG, remat="save_matmuls")
    mesh = make_mesh(fsdp=2, sp=1, devices=jax.devices()[:2])
    batch = {k: jnp.asarray(v) for k, v in random_batch(3, 2).items()}
    graphdef, adapters, frozen = _random_adapters(cfg, mesh)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda t: _loss_sums(graphdef, lora.join(t, frozen), batch, None)[0], adapters)
    saved = [line.split()[0] for line in out.getvalue().splitlines()]
    rows, seq = batch["tokens"].shape
    mlp_wide = f"f32[{cfg.num_layers},{rows},{seq},{cfg.mlp_dim}]"
    assert saved.count(mlp_wide) == 2, saved  # gate's and up's base products; their adapters' terms recomputed
    assert saved.count(f"f32[{cfg.num_layers},{rows},{seq},{cfg.lora.rank}]") == 7, saved  # each target's x A
    loss, grads = _loss_and_grads(cfg, mesh, batch)
    ref_loss, ref_grads = _loss_and_grads(LCFG, mesh, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        assert np.abs(r).max() > 0
        np.testing.assert_allclose(g, r, atol=1e-6 * np.abs(r).max(), rtol=1e-5)


def test_lora_config_refusals():
    with pytest.raises(ValueError, match=r"--lora-rank \(0\) must be a positive integer"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="'x' is not a projection this model has; it has q,k,v,o,gate,up,down"):
        LoraConfig(targets="q,x")
    assert LoraConfig(targets="v_proj,q").targets == ("q", "v")  # peft's names too, in the model's order
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"--lora-dropout \(.*\) must be a probability in \[0, 1\)"):
            LoraConfig(dropout=bad)
    with pytest.raises(ValueError, match="--lora-dropout 0.1 with --attn-chunk 4 on the attention targets"):
        dataclasses.replace(LCFG, lora=LoraConfig(dropout=0.1), attn_chunk=4)
    dataclasses.replace(LCFG, lora=LoraConfig(dropout=0.1, targets="gate,up,down"), attn_chunk=4)  # MLP only: fine
    moe = dataclasses.replace(CFG, num_experts=4, experts_per_token=2)
    with pytest.raises(ValueError, match="'gate': .* mixture of experts"):
        LoraConfig().check(moe)
    LoraConfig(targets="q,k,v,o").check(moe)
    narrow = dataclasses.replace(CFG, lora=None)
    sides = {t: min(projection_sides(narrow)[t]) for t in LoraConfig().targets}
    with pytest.raises(ValueError, match="'in_proj_qkv': .* has no gated delta-net"):
        LoraConfig(targets="q,in_proj_qkv").check(narrow)
    least = min(sides.values())
    LoraConfig(rank=least).check(narrow)
    with pytest.raises(ValueError, match=rf"^--lora-rank {least + 1} is larger than the \w+ projection's smaller side "
                                         rf"\({least}: .*use --lora-rank {least} or less$"):
        LoraConfig(rank=least + 1).check(narrow)


def test_resuming_a_lora_run_without_its_adapters_names_the_rank():
    from ulysses_jax.train.config import TrainConfig, with_lora

    record = {"config": {"lora_rank": 16, "lora_alpha": 32.0}}
    given = TrainConfig(lora_rank=None, lora_alpha=32.0)  # what a resume with --lora-rank None leaves
    with pytest.raises(ValueError, match=r"^--lora-rank None: this run trains LoRA adapters of rank 16, which a "):
        with_lora(given, CFG, record=record)
    with pytest.raises(ValueError, match=r"^--lora-alpha qualifies LoRA adapters, but --lora-rank is not set"):
        with_lora(given, CFG)  # a new run: the flag given without a rank is the one named


# ------------------------------------------------------------------------------------ the CLI, transformers, peft


def _peft_model(base_folder, adapter):
    """peft's model of ``adapter`` on ``base_folder`` and whatever it warned or logged."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = peft.PeftModel.from_pretrained(base, adapter)
    finally:
        logging.getLogger().removeHandler(handler)
    said = " ".join([str(w.message) for w in caught] + [r.getMessage() for r in records]).lower()
    return model.eval(), said


def test_adapter_and_merged_folder_load_in_peft_and_transformers(tmp_path):
    """In-process (the default suite's): adapters with random B on a folder's model, written as a peft adapter and as
    a merged folder: peft and transformers load them with the same logits, and ours are theirs."""
    pytest.importorskip("peft")
    from ulysses_jax.interop import hf, peft
    from ulysses_jax.train.config import TrainConfig, model_config
    from ulysses_jax.train.devices import MeshConfig, build_mesh
    from ulysses_jax.train.trainer import _hf_weights

    folder = hf_helpers.make_folder(tmp_path / "tiny-llama")
    cfg = TrainConfig(init_from_hf=str(folder), seq_len=32, attention="xla", mesh=MeshConfig(fsdp=2, sp=4),
                      lora_rank=4, lora_targets="q,o,down", param_dtype="float32")
    config = dataclasses.replace(model_config(cfg, 0), compute_dtype="float32")
    mesh = build_mesh(cfg.mesh, config, cfg.seq_len)
    model = _hf_weights(str(folder), config, mesh, seed=0)
    for t in config.lora.targets:  # B random: the adapters change the model
        var = getattr(model.blocks.lora, f"w_{t}_b")
        var.set_value(var.get_value() + 0.05 * jax.random.normal(jax.random.key(1), var.get_value().shape))
    peft.write_adapter(model, tmp_path / "adapter", base_model=str(folder))
    hf.to_hf(peft.merged(model), tmp_path / "merged")
    tokens = np.random.default_rng(0).integers(0, hf_helpers.VOCAB, (2, 32))
    with_peft, said = _peft_model(folder, tmp_path / "adapter")
    assert not any(w in said for w in ("missing", "unexpected")), said
    theirs = hf_helpers.hf_logits(with_peft, tokens)
    merged = hf_helpers.hf_logits(hf_helpers.load_quietly(tmp_path / "merged"), tokens)
    ours = np.asarray(jax.jit(lambda t: model.logits(model.hidden_states(t)))(jnp.asarray(tokens)))
    assert np.abs(theirs - hf_helpers.hf_logits(hf_helpers.load_quietly(folder), tokens)).max() > 1e-2  # adapted
    assert np.abs(theirs - merged).max() <= 1e-4 and np.abs(ours - theirs).max() <= 1e-4


@pytest.mark.slow
def test_lora_run_exports_an_adapter_peft_loads_and_a_merged_folder(tmp_path, capsys):
    pytest.importorskip("peft")
    from safetensors.numpy import load_file

    folder = hf_helpers.make_folder(tmp_path / "tiny-llama")
    corpus, run, straight = hf_helpers.write_corpus(tmp_path / "c.jsonl"), tmp_path / "run", tmp_path / "straight"
    common = ["--init-from-hf", folder, "--data", corpus, "--lora-rank", "8", "--lora-dropout", "0.1",
              "--param-dtype", "float32",
              *hf_helpers.FLAGS]
    assert main([str(a) for a in ["train", *common, "--steps", "2", "--checkpoint-every", "1", "--run-dir", run]]) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 8, alpha 16 (scale 2), dropout 0.1, on q,k,v,o,gate,up,down: " in out, out
    assert "peak lr 0.0002 (LoRA default for --lora-rank)" in out, out
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["lora_rank"] == 8 and record["config"]["lora_alpha"] == 16.0
    assert record["model"]["lora"]["targets"] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert record["defaults"]["lora_alpha"]["why"] == "2 x --lora-rank"

    # resume is exact: 2 steps and a resume to 3 = 3 steps at once
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "3"]) == 0
    assert main([str(a) for a in ["train", *common, "--steps", "3", "--run-dir", straight]]) == 0
    capsys.readouterr()
    losses = [[json.loads(x)["loss"] for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, straight)]
    assert losses[0] == losses[1], losses

    # bad input: one line, exit 2, nothing written
    metrics = (run / "metrics.jsonl").read_text()
    hf_helpers.refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "4", "--lora-rank", "4"],
                       "--lora-rank is 4 here but 8 in the run")
    hf_helpers.refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "4", "--lora-rank", "None"],
                       "--lora-rank None: this run trains LoRA adapters of rank 8, which a resumed run keeps")
    assert (run / "metrics.jsonl").read_text() == metrics and runs_steps(run) == (1, 2, 3)
    for flags, needle in ((["--lora-rank", "0"], "--lora-rank (0) must be a positive integer"),
                          (["--lora-rank", "-2"], "--lora-rank (-2) must be a positive integer"),
                          (["--lora-rank", "4", "--lora-targets", "q,qkv"], "'qkv' is not a projection"),
                          (["--lora-alpha", "8"], "--lora-alpha qualifies LoRA adapters")):
        new = tmp_path / "new"
        hf_helpers.refused(capsys, ["train", "--init-from-hf", folder, "--data", corpus, *hf_helpers.FLAGS, *flags,
                                    "--run-dir", new], needle)
        assert not new.exists()

    # the adapter: peft loads it onto the folder's model with no missing or unexpected key
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", "--run-dir", str(run), "--out", str(adapter)]) == 0
    assert "peft.PeftModel.from_pretrained" in capsys.readouterr().out
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(folder.resolve()))
    assert config["lora_dropout"] == 0.1
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    import peft

    model, said = _peft_model(folder, adapter)
    assert not any(w in said for w in ("missing", "unexpected")), said
    ours = load_file(adapter / "adapter_model.safetensors")
    theirs = {k: v.numpy() for k, v in peft.get_peft_model_state_dict(model).items()}
    assert set(ours) == set(theirs) and len(ours) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert ours["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (8, 64)  # [r, in]
    assert ours["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 8)  # [out, r]
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])

    # merged: transformers loads it; its logits are peft's (and ours); only the target projections changed
    hf_helpers.refused(capsys, ["export", "--run-dir", run, "--out", adapter, "--merge"], "is not an empty folder")
    assert main(["export", "--run-dir", str(run), "--out", str(merged), "--merge"]) == 0
    capsys.readouterr()
    tokens = np.random.default_rng(0).integers(0, hf_helpers.VOCAB, (2, 32))
    with_merge = hf_helpers.hf_logits(hf_helpers.load_quietly(merged), tokens)
    with_peft = hf_helpers.hf_logits(model, tokens)
    assert np.abs(with_peft - with_merge).max() <= 1e-4
    assert np.abs(hf_helpers.our_logits(run, 3, tokens) - with_peft).max() <= 1e-4
    original, after = load_file(folder / "model.safetensors"), load_file(merged / "model.safetensors")
    assert set(original) == set(after)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name in original:
        same = np.array_equal(original[name], after[name])
        assert same != any(f".{t}." in name for t in targets), name


def test_merge_writes_the_base_folders_tensors_and_export_finds_a_moved_base(tmp_path, capsys):
    """A float32 folder, a LoRA run with the default bfloat16 base: ``export --merge`` writes every other tensor byte
    for byte and each target as ``W + scale B A`` in float32 from the folder's W (no bfloat16 copy in between), and
    peft's model on the folder gives the merged folder's logits. After the folder moves, ``--base`` names it: the
    adapter's ``base_model_name_or_path`` is the new place and ``--merge`` reads it there; without it ``--merge`` is
    refused in one line, as is a folder that is not the run's."""
    pytest.importorskip("peft")
    from safetensors.numpy import load_file

    folder = hf_helpers.make_folder(tmp_path / "tiny-llama")
    corpus, run = hf_helpers.write_corpus(tmp_path / "c.jsonl"), tmp_path / "run"
    args = ["train", "--init-from-hf", folder, "--data", corpus, "--lora-rank", "4", "--lora-targets", "q,v,down",
            "--optim.lr", "0.01", "--steps", "2", "--checkpoint-every", "2", "--run-dir", run, *hf_helpers.FLAGS]
    assert main([str(a) for a in args]) == 0
    assert json.loads((run / "run.json").read_text())["model"]["param_dtype"] == "bfloat16"
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    hf_helpers.refused(capsys, ["export", "--run-dir", run, "--out", tmp_path / "m0", "--merge"],
                       f"which is gone; pass where it is now with --base DIR")
    hf_helpers.refused(capsys, ["export", "--run-dir", run, "--out", tmp_path / "a0"],
                       "if the run's base folder moved, pass it with --base DIR")
    hf_helpers.refused(capsys, ["export", "--run-dir", run, "--out", tmp_path / "a0", "--base", corpus.parent],
                       f"--base {corpus.parent} has no config.json")
    assert not (tmp_path / "m0").exists() and not (tmp_path / "a0").exists()
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for out, extra in ((adapter, []), (merged, ["--merge"])):
        assert main(["export", "--run-dir", str(run), "--out", str(out), "--base", str(moved), *extra]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(moved.resolve())
    original, after = load_file(moved / "model.safetensors"), load_file(merged / "model.safetensors")
    lora_ab = load_file(adapter / "adapter_model.safetensors")
    assert set(original) == set(after) and all(x.dtype == np.float32 for x in after.values())
    changed = 0
    for name, w in original.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if key + ".lora_A.weight" not in lora_ab:
            assert after[name].tobytes() == w.tobytes(), name  # byte for byte
            continue
        a, b = lora_ab[key + ".lora_A.weight"], lora_ab[key + ".lora_B.weight"]
        np.testing.assert_array_equal(after[name], w + np.float32(config["lora_alpha"] / config["r"]) * (b @ a))
        changed += not np.array_equal(after[name], w)
    assert changed == 3 * 2  # q, v and down of both layers moved
    tokens = np.random.default_rng(0).integers(0, hf_helpers.VOCAB, (2, 32))
    with_peft, _ = _peft_model(moved, adapter)
    with_merge = hf_helpers.hf_logits(hf_helpers.load_quietly(merged), tokens)
    assert np.abs(hf_helpers.hf_logits(with_peft, tokens) - with_merge).max() <= 1e-4


def runs_steps(run):
    from ulysses_jax.train import runconfig

    return runconfig.inspect(run).steps


def test_a_merged_folders_longer_context_keeps_the_rope_it_learned():
    """`export --merge` of a run trained past the folder's max_position_embeddings raises it; a YaRN scaling that
    leaves out original_max_position_embeddings (transformers derives it from max_position_embeddings) has it pinned
    to the folder's length first, so the merged model's RoPE stays the one trained (found by a review)."""
    transformers = pytest.importorskip("transformers")
    from ulysses_jax.interop.peft import merged_config

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    base = dict(model_type="qwen3", vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64)
    for layout in ({"rope_parameters": yarn}, {"rope_theta": 1e6, "rope_scaling": dict(yarn)}):
        config = {**base, **json.loads(json.dumps(layout))}
        merged = merged_config(config, "bfloat16", 256)
        assert merged["max_position_embeddings"] == 256 and merged["torch_dtype"] == "bfloat16"
        before, after = (transformers.Qwen3Config(**{k: v for k, v in json.loads(json.dumps(c)).items()
                                                     if k != "model_type"}) for c in (config, merged))
        assert before.rope_parameters["original_max_position_embeddings"] == 64
        assert after.rope_parameters["original_max_position_embeddings"] == 64, layout
        assert config == {**base, **layout}  # the base folder's own dict is left as it was
    plain = merged_config(dict(base, rope_theta=1e6), None, 32)  # shorter: nothing changes
    assert plain == dict(base, rope_theta=1e6)
