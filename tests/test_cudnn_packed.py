"""Packed rows on cuDNN (``kernels/cudnn_packed.py``): the segment-ids-to-offsets conversion against the mask it
stands for, the host-side refusal of rows the bound cannot describe, and the compiled program for a compile-only
H100 (cuDNN's fused attention forward and backward, no Triton kernel). The numerics on a GPU: tests/test_gpu.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulysses_jax.data.pipeline import check_documents_per_row
from ulysses_jax.kernels.attention import attention, attention_mask, resolve_impl
from ulysses_jax.kernels.cudnn_packed import (
    around_packed,
    default_max_documents,
    packed_workspace_bytes,
    ragged_mask,
    resolve_max_documents,
    rows_not_described,
    segments_to_ragged,
)
from ulysses_jax.kernels.segments import document_starts, documents_per_row, padding, split_documents
from ulysses_jax.model.config import ModelConfig

# jitted here: op by op, each call compiled a program per operation (27 s of a cold run on one core, 3 s jitted)
_to_ragged = jax.jit(segments_to_ragged, static_argnums=1)
_ragged_mask = jax.jit(ragged_mask, static_argnums=2, static_argnames=("causal", "window"))
_segment_mask = jax.jit(attention_mask, static_argnums=0, static_argnames=("causal", "window"))
_not_described = jax.jit(rows_not_described, static_argnums=1)


def packed_rows(rng, rows: int, s: int) -> np.ndarray:
    """Rows as the packer writes them, drawn at random: documents 1, 2, ... of random lengths (length 1 often), then
    padding (0) at the end; some rows all padding, some one document."""
    out = np.zeros((rows, s), np.int32)
    for r in range(rows):
        real = int(rng.integers(0, s + 1))
        pos, doc = 0, 1
        while pos < real:
            n = int(rng.choice([1, 1, 2, 3, int(rng.integers(1, s + 1))]))
            out[r, pos:min(real, pos + n)] = doc
            pos, doc = pos + n, doc + 1
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_offsets_stand_for_the_segment_mask(causal, seed):
    """For random packed rows, the mask the (seqlen, offsets) describe equals the segment-id mask restricted to real
    tokens: same document, nothing across documents, no padding token inside any document; with a window too."""
    rng = np.random.default_rng(seed)
    for s, m in [(1, 1), (5, 5), (33, 33)] * 3 + [(33, None)] * 3:  # few shapes (each compiles once); M exact too
        seg = jnp.asarray(packed_rows(rng, 4, s))
        m = m or max(int(documents_per_row(np.asarray(seg)).max(initial=0)), 1)
        seqlen, offsets, count = _to_ragged(seg, m)
        zeros_row = ~np.asarray(seg).any(axis=1)  # a row of zeros is one document to cuDNN, as to the other kernels
        np.testing.assert_array_equal(count, documents_per_row(np.asarray(seg)))  # the data path's count, the same
        real = np.asarray(seg != 0) | zeros_row[:, None]
        for window in (None, 3):
            want = np.asarray(_segment_mask(s, causal=causal, segment_ids=seg, window=window))
            want = want & real[:, None, None, :, None] & real[:, None, None, None, :]
            got = np.asarray(_ragged_mask(seqlen, offsets, s, causal=causal, window=window))
            np.testing.assert_array_equal(got, want)


def test_ragged_layout_is_what_cudnn_reads():
    """Two rows of 3 and 2 one-token documents, M = 3 (jax's docstring example): offsets [[0, 1, 2, -1], [0, 1, -1,
    -1]], lengths 1 padded with -1; a row of one document then padding; ids need not start at 1."""
    seg = jnp.asarray([[1, 2, 3, 0], [7, 9, 0, 0], [5, 5, 5, 0]], jnp.int32)
    seqlen, offsets, count = _to_ragged(seg, 3)
    np.testing.assert_array_equal(offsets, [[0, 1, 2, -1], [0, 1, -1, -1], [0, -1, -1, -1]])
    np.testing.assert_array_equal(seqlen, [[1, 1, 1], [1, 1, -1], [3, -1, -1]])
    np.testing.assert_array_equal(count, [3, 2, 1])
    assert not bool(_not_described(seg, 3)) and bool(_not_described(seg, 2))
    # a change of id marks a new document even between equal neighbours further apart
    np.testing.assert_array_equal(jax.jit(document_starts)(jnp.asarray([[4, 4, 6, 4, 0]])), [[1, 0, 1, 1, 0]])
    # ids counted from 0: only the zeros after the last nonzero id are padding; a row of zeros is one document
    seg = jnp.asarray([[0, 0, 1, 1, 2], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(jax.jit(padding)(seg), [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    seqlen, offsets, count = _to_ragged(seg, 3)
    np.testing.assert_array_equal(offsets, [[0, 2, 4, -1], [0, 2, -1, -1], [0, -1, -1, -1]])
    np.testing.assert_array_equal(seqlen, [[2, 2, 1], [2, 1, -1], [5, -1, -1]])


def test_rows_beyond_the_bound_are_refused_before_the_step():
    seg = np.array([[1, 1, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    np.testing.assert_array_equal(documents_per_row(seg), [3, 1])
    check_documents_per_row({"segment_ids": seg}, 3)
    with pytest.raises(ValueError, match=r"^a row holds 3 documents, more than --attn-max-documents 2 .*raise "
                                         r"--attn-max-documents .* or use --attention pallas$"):
        check_documents_per_row({"segment_ids": seg}, 2)
    one = np.array([[0, 0, 1, 1]], np.int32)  # ids from 0: two documents to the data path and to cuDNN alike
    check_documents_per_row({"segment_ids": one}, 2)
    with pytest.raises(ValueError, match=r"^a row holds 2 documents, more than --attn-max-documents 1 "):
        check_documents_per_row({"segment_ids": one}, 1)


@pytest.mark.parametrize("row", [[0, 0, 1, 1, 2, 2, 0, 0], [1, 1, 0, 0, 2, 2, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0],
                                 [3, 3, 3, 3, 3, 3, 3, 3], [1, 2, 3, 4, 5, 6, 7, 0]])
def test_the_data_path_and_cudnn_count_documents_alike(row):
    """Zeros before or between documents are documents to both (only the zeros after the last nonzero id are
    padding): a bound equal to the data path's count describes the row (no NaN), one less is refused up front."""
    seg = np.asarray([row], np.int32)
    n = int(documents_per_row(seg)[0])
    assert n == int(_to_ragged(jnp.asarray(seg), 8)[2][0])
    for m in {1, n, 8}:
        beyond = bool(_not_described(jnp.asarray(seg), m))
        assert beyond == (n > m)
        if beyond:
            with pytest.raises(ValueError, match=f"^a row holds {n} documents, more than --attn-max-documents {m} "):
                check_documents_per_row({"segment_ids": seg}, m)
        else:
            check_documents_per_row({"segment_ids": seg}, m)


def test_one_id_for_two_runs_is_refused_everywhere():
    """``[1, 1, 2, 2, 1, 1, 0, 0]``: the id-comparing kernels would join the two runs of 1 across the gap, cuDNN
    would split them; neither is taken. attention() refuses concrete rows, the data path refuses the batch (with or
    without a cuDNN bound), and inside a program cuDNN's packed path marks the row (its output turns NaN)."""
    seg = np.asarray([[1, 1, 2, 2, 1, 1, 0, 0], [1, 1, 2, 2, 3, 3, 0, 0]], np.int32)
    assert split_documents(seg).tolist() == [True, False]
    want = r"^row 0 uses segment id 1 for separate runs of tokens \(starting at positions 0, 4\); a document's"
    for limit in (None, 16):
        with pytest.raises(ValueError, match=want):
            check_documents_per_row({"segment_ids": seg}, limit)
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 2, 8)), jnp.float32)
    for impl in ("xla", "blockwise"):
        with pytest.raises(ValueError, match=want):
            attention(q, q, q, segment_ids=jnp.asarray(seg), impl=impl)
    attention(q, q, q, segment_ids=jnp.asarray(seg[1:2].repeat(2, 0)), impl="xla")  # contiguous documents pass
    for m in (1, 3, 16):
        assert bool(_not_described(jnp.asarray(seg[:1]), m))
        assert not bool(_not_described(jnp.asarray(seg[1:]), max(m, 3)))


def test_rows_cudnn_cannot_describe_turn_the_output_nan():
    """``around_packed`` (every cuDNN path's wrapper) with a stand-in kernel on the CPU: a row within the bound gives
    the kernel's output with padding zeroed; a row beyond it, or with one id for two runs, makes the output NaN."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float32) for _ in range(3))

    def call(q, k, v):
        return attention(q, k, v, impl="xla")

    fine = jnp.asarray([[1, 1, 2, 2, 3, 3, 0, 0]], jnp.int32)
    out = around_packed(call, q, k, v, fine, 3)
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(out[:, 6:] == 0))
    assert bool(jnp.all(jnp.isnan(around_packed(call, q, k, v, fine, 2))))
    split = jnp.asarray([[1, 1, 2, 2, 1, 1, 0, 0]], jnp.int32)
    assert bool(jnp.all(jnp.isnan(jax.jit(lambda q, k, v, s: around_packed(call, q, k, v, s, 4))(q, k, v, split))))


def test_attn_max_documents_is_checked():
    with pytest.raises(ValueError, match=r"attn_max_documents \(-1\) must be a number of documents per row"):
        ModelConfig(attn_max_documents=-1)
    assert [default_max_documents(s) for s in (2048, 32768, 65536, 131072, 524288, 1048576)] == [16, 16, 8, 4, 1, 1]
    assert resolve_max_documents(0, 131072) == 4 and resolve_max_documents(3, 131072) == 3


def test_workspace_rule_matches_the_h100_measurement():
    """The rule fitted on an H100 (experiments/results/gpu_h100_20261126): S 32768, 32 heads, D 128; temp 8.31 GiB
    at M = 8 and 32.50 GiB at M = 32 with 1.01 GiB of the unpacked call's own; the rule gives the difference."""
    gib = 2**30
    assert abs(packed_workspace_bytes(1, 32768, 32, 128, 8) / gib - (8.31 - 0.25)) < 0.1
    assert abs(packed_workspace_bytes(1, 32768, 32, 128, 32) / gib - (32.50 - 0.25)) < 0.3
    assert packed_workspace_bytes(1, 32768, 32, 128, 1) == 0


def test_auto_picks_cudnn_for_packed_rows_on_gpu():
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=128, has_segment_ids=True, platform="gpu") == "cudnn"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=256, has_segment_ids=True, platform="gpu") == "cudnn"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=264, has_segment_ids=True, platform="gpu") == "pallas"
    assert resolve_impl("auto", dtype=jnp.float32, head_dim=128, has_segment_ids=True, platform="gpu") == "pallas"


def _compiled_text(dev, impl, *, h, hkv, window, max_documents, s=4096, d=128):
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(dev)
    q = jax.ShapeDtypeStruct((2, s, h, d), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((2, s, hkv, d), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((2, s), jnp.int32, sharding=sh)

    def loss(q, k, v, seg):
        o = attention(q, k, v, causal=True, segment_ids=seg, impl=impl, platform="gpu", window=window,
                      max_documents=max_documents)
        return o.astype(jnp.float32).sum()

    with jax.default_device(dev):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg).lower().compile().as_text()


@pytest.mark.aot
@pytest.mark.parametrize("h,hkv,window,m,d", [(8, 8, None, 16, 128), (8, 2, None, 16, 128), (8, 2, 512, 4, 128),
                                               (8, 2, None, 1, 128), (4, 1, None, 1, 256)],
                         ids=["mha", "gqa", "gqa-window", "gqa-one-document", "hd256"])
def test_packed_cudnn_compiles_for_h100_without_triton(h, hkv, window, m, d):
    """``attention(..., segment_ids=s, impl="cudnn", platform="gpu")`` forward and backward for a compile-only H100:
    cuDNN's fused attention each way, no Triton kernel; ``impl="auto"`` gives the same program (head_dim 256 too:
    Qwen3.5's full-attention layers, which Hopper's cuDNN takes)."""
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)[0]
    text = _compiled_text(dev, "cudnn", h=h, hkv=hkv, window=window, max_documents=m, d=d)
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
    assert len(calls) == 2 and sum("Backward" in c for c in calls) == 1, calls
    # no Pallas kernel and no Triton matmul: XLA's only Triton fusions here are the [B, S] reductions that find each
    # row's padding (kernels/cudnn_packed.padding)
    assert "xla.gpu.triton" not in text and '"__triton_gemm' not in text
    triton = [line for line in text.splitlines() if '"kind":"__triton"' in line]
    assert all("reduce" in line.split("=")[0] for line in triton), triton
    if window:
        assert text.count("sliding_window_length") >= 2
    # one document a row (M = 1): cuDNN's causal mask alone, no sequence lengths; more: the padded, packed layout
    masks = re.findall(r'"mask_type":\s*"(\w+)"', text)
    assert masks == (["CAUSAL"] * 2 if m == 1 else ["PADDING_CAUSAL"] * 2), masks
    auto = _compiled_text(dev, "auto", h=h, hkv=hkv, window=window, max_documents=m, d=d)
    assert re.findall(r'custom_call_target="([^"]*)"', auto) == re.findall(r'custom_call_target="([^"]*)"', text)


def test_auto_says_why_it_does_not_run_cudnn(monkeypatch):
    from ulysses_jax.kernels import attention as attention_mod
    from ulysses_jax.kernels.attention import auto_reason, cudnn_max_head_dim, resolve_impl

    assert auto_reason(dtype=jnp.bfloat16, head_dim=128, platform="gpu") is None
    # head_dim 256 (Qwen3.5): cuDNN on Hopper (the compile-only targets here), our kernel before Hopper
    assert auto_reason(dtype=jnp.bfloat16, head_dim=256, platform="gpu") is None
    assert auto_reason(dtype=jnp.bfloat16, head_dim=264, platform="gpu") == (
        "cuDNN needs head_dim a multiple of 8 and at most 256 (compute capability 9.0), got 264")
    assert (cudnn_max_head_dim((8, 0)), cudnn_max_head_dim((9, 0)), cudnn_max_head_dim((10, 0))) == (128, 256, 256)
    monkeypatch.setattr(attention_mod, "gpu_capability", lambda: (8, 0))  # an A100
    assert auto_reason(dtype=jnp.bfloat16, head_dim=256, platform="gpu") == (
        "cuDNN needs head_dim a multiple of 8 and at most 128 (compute capability 8.0), got 256")
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=256, has_segment_ids=True, platform="gpu") == "pallas"
    assert auto_reason(dtype=jnp.float32, head_dim=128, platform="gpu") == (
        "cuDNN needs float16 or bfloat16 inputs, got float32")
    assert auto_reason(dtype=jnp.bfloat16, head_dim=128, platform="gpu", ring=2).startswith("cuDNN has no ring kernel")
    assert auto_reason(dtype=jnp.bfloat16, head_dim=128, platform="cpu") is None


def _short_documents(path, n=200):
    import json as _json

    path.write_text("".join(_json.dumps({"text": f"doc {i} is short"}) + "\n" for i in range(n)))
    return path


@pytest.mark.aot
def test_eval_raises_the_bound_to_what_its_rows_hold_and_training_refuses_up_front(tmp_path):
    """On GPUs (compile-only H100s here) with cuDNN's packed attention: the eval job counts the documents of its own
    rows before compiling and raises the model's bound to fit them; the evaluation during training (whose step is
    the training step's) refuses such rows before the run starts, naming the flag."""
    from ulysses_jax.data.documents import DataConfig
    from ulysses_jax.data.pipeline import check_eval_documents
    from ulysses_jax.evaluation.evaluate import _documents_bound
    from ulysses_jax.parallel.mesh import make_mesh
    from ulysses_jax.plan.targets import target_devices
    from ulysses_jax.train.devices import documents_limit

    mesh = make_mesh(sp=8, devices=target_devices("h100", devices=8))
    model = ModelConfig.from_preset("tiny", attention_impl="auto", compute_dtype="bfloat16")
    corpus = _short_documents(tmp_path / "short.jsonl")
    data = DataConfig(paths=(str(corpus),), eval_paths=(str(corpus),), eval_fraction=0.0)
    assert documents_limit(model, mesh, 512) == 16  # cuDNN, the default bound at 512 tokens
    bounded, limit = _documents_bound(model, mesh, data, 512, 1, 2, None)
    assert limit > 16 and bounded.attn_max_documents == limit  # rows of ~5-token documents hold dozens
    with pytest.raises(ValueError, match=r"^evaluation during training: a row holds \d+ documents, more than "
                                         r"--attn-max-documents 16"):
        check_eval_documents(data, 512, 1, 2, 16, "evaluation during training")
    cpu_model = dataclasses.replace(model, attention_impl="blockwise")
    assert _documents_bound(cpu_model, mesh, data, 512, 1, 2, None) == (cpu_model, None)


@pytest.mark.aot
def test_the_ring_takes_any_number_of_documents_on_gpus():
    """With a ring (``--mesh.ring > 1``) each ring step runs our kernel, whatever ``auto`` would pick without one, so
    no cuDNN bound applies: rows of many documents at 32K and of two at 512K are not refused."""
    from ulysses_jax.parallel.mesh import make_mesh
    from ulysses_jax.plan.targets import target_devices
    from ulysses_jax.train.devices import documents_limit

    devices = target_devices("h100", devices=8)
    model = ModelConfig.from_preset("tiny", attention_impl="auto", compute_dtype="bfloat16")
    assert documents_limit(model, make_mesh(sp=8, devices=devices), 524288) == 1
    ring = make_mesh(ring=2, sp=4, devices=devices)
    assert documents_limit(model, ring, 32768) is None and documents_limit(model, ring, 524288) is None


def test_around_packed_masks_the_gradients_at_padding_not_the_inputs():
    """The kernel gets Q, K, V as they are (no masked copies); the output is zero at padding, and the gradients of
    Q, K, V are exactly zero there and the kernel's own elsewhere."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32) for _ in range(3))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    seen = []

    def call(q, k, v):
        seen.append(q)
        return jnp.tanh(q) * k + v  # elementwise: each token's gradient its own

    around_packed(call, q, k, v, seg, 2)
    assert bool(jnp.all(seen[0] == q)) and bool(jnp.any(q[:, 6:] != 0))  # padding not zeroed: no masked copy
    out, vjp = jax.vjp(lambda q, k, v: around_packed(call, q, k, v, seg, 2), q, k, v)
    assert bool(jnp.all(out[:, 6:] == 0)) and bool(jnp.all(out[:, :6] == call(q, k, v)[:, :6]))
    dout = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    want = jax.vjp(call, q, k, v)[1](dout)
    for got, full in zip(vjp(dout), want):
        assert bool(jnp.all(got[:, 6:] == 0)) and bool(jnp.all(got[:, :6] == full[:, :6]))


def test_one_document_rows_need_no_mask_but_causality(seed):
    """``M = 1`` (``--attn-max-documents 1``) runs cuDNN with its causal mask alone: a row is one document from its
    start, then padding, so no token of the document reads a later one. Here with XLA's kernel in cuDNN's place inside
    ``around_packed``: outputs and the gradients of Q, K, V equal the segment-masked reference at every token (the
    padding's zeroed, as the reference's cotangent-free rows are masked), fresh rows with trailing padding of random
    lengths, GQA; a row of two documents makes the output NaN (zeros first and a document after them are two:
    ``kernels/segments.py``)."""
    from ulysses_jax.kernels.cudnn_packed import around_packed

    b, s, h, hkv, d = 3, 64, 4, 2, 16
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, s + 1, b)
    seg = jnp.asarray((np.arange(s)[None] < lengths[:, None]).astype(np.int32))
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, h, d), jnp.float32)
    k, v = (jax.random.normal(x, (b, s, hkv, d), jnp.float32) for x in ks[1:3])
    real = (seg > 0)[:, :, None, None]
    do = jnp.where(real, jax.random.normal(ks[3], (b, s, h, d), jnp.float32), 0.0)

    def ours(q, k, v, seg=seg):
        return around_packed(lambda q, k, v: attention(q, k, v, causal=True, impl="xla"), q, k, v, seg, 1)

    def reference(q, k, v):
        return jnp.where(real, attention(q, k, v, causal=True, segment_ids=seg, impl="xla"), 0.0)

    (o1, vjp1), (o0, vjp0) = jax.vjp(ours, q, k, v), jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(o1, o0, atol=1e-5, rtol=1e-5)
    for g1, g0 in zip(vjp1(do), vjp0(do)):
        np.testing.assert_allclose(g1, g0, atol=1e-5, rtol=1e-5)
    pad_first = seg.at[0].set(jnp.asarray((np.arange(s) >= 5).astype(np.int32)))
    two_docs = seg.at[1].set(jnp.asarray((1 + (np.arange(s) >= s // 2)).astype(np.int32)))
    for bad in (pad_first, two_docs):
        assert np.isnan(np.asarray(ours(q, k, v, bad))).all()
