"""Pallas flash attention vs the jnp reference and an independent float64 NumPy forward + backward.

On CPU every kernel runs in Pallas interpret mode (``interpret=None`` resolves to it at call time).
GPU tests (compiled Triton kernels, long sequences) carry ``@pytest.mark.gpu``.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from np_reference import attention_f64, rel_err

from ulysses_jax.kernels.flash_attention import flash_attention, kv_block_bound, q_block_range, reference
from ulysses_jax.kernels.flash_blocks import BlockSizes

# Tolerances on rel_err = max|x - expected| / max|expected| (outputs and each gradient).
# float32: interpret mode computes in float32 throughout; measured errors are ~1e-6.
# bfloat16: outputs/gradients are rounded to bf16 (2^-8 = 3.9e-3 relative) and P, dS are rounded to
# bf16 before their matmuls; the float64 reference sees the same bf16-rounded inputs.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def attention_np(q, k, v, do, *, causal, segment_ids, scale):
    """The shared float64 NumPy reference, as (out, dq, dk, dv)."""
    out, (dq, dk, dv) = attention_f64(q, k, v, do, causal=causal, segment_ids=segment_ids, scale=scale)
    return out, dq, dk, dv


# --------------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    s: int
    h: int
    hkv: int
    d: int
    dtype: type = jnp.float32
    causal: bool = True
    segments: bool = False
    blocks: tuple | None = None  # (q, k, q_dkv, k_dkv, q_dq, k_dq); None = BlockSizes() defaults
    scale: float | None = None
    b: int = 2

    @property
    def block_sizes(self):
        return None if self.blocks is None else BlockSizes(*self.blocks)


def _blocks(n):
    return (n,) * 6


MIXED_A = (32, 16, 16, 32, 32, 16)
MIXED_B = (16, 32, 32, 16, 16, 32)

CASES = [
    Case("mha-f32-d32-s64-b16-causal", 64, 2, 2, 32, blocks=_blocks(16)),
    Case("mha-f32-d32-s64-b32-full", 64, 2, 2, 32, causal=False, blocks=_blocks(32)),
    Case("gqa-f32-d16-s128-mixedA-causal", 128, 4, 2, 16, blocks=MIXED_A),
    Case("mqa-f32-d16-s128-mixedB-full", 128, 4, 1, 16, causal=False, blocks=MIXED_B),
    Case("seg-mha-f32-d32-s128-b32-causal", 128, 2, 2, 32, segments=True, blocks=_blocks(32)),
    Case("seg-gqa-f32-d16-s96-mixedB-full", 96, 4, 2, 16, causal=False, segments=True, blocks=MIXED_B),
    Case("odd-mha-f32-d32-s100-b32-causal", 100, 2, 2, 32, blocks=_blocks(32)),
    Case("odd-seg-mqa-f32-d16-s37-b16-full", 37, 2, 1, 16, causal=False, segments=True, blocks=_blocks(16)),
    Case("odd-seg-gqa-f32-d16-s37-mixedA-causal", 37, 4, 2, 16, segments=True, blocks=MIXED_A),
    Case("bf16-gqa-d64-s128-b32-causal", 128, 4, 2, 64, jnp.bfloat16, blocks=_blocks(32)),
    Case("bf16-seg-mha-d64-s100-b32-full", 100, 2, 2, 64, jnp.bfloat16, causal=False, segments=True,
         blocks=_blocks(32)),
    Case("bf16-mqa-d32-s64-mixedB-causal", 64, 4, 1, 32, jnp.bfloat16, blocks=MIXED_B),
    Case("bf16-gqa-d128-s64-b32-full", 64, 4, 2, 128, jnp.bfloat16, causal=False, blocks=_blocks(32), b=1),
    Case("default-blocks-f32-d64-s64-causal", 64, 2, 2, 64),
    Case("d24-scale0.3-f32-s64-b16-causal", 64, 2, 2, 24, blocks=_blocks(16), scale=0.3),
]


def _seed(name: str) -> int:
    """Per-case seed, fresh each session (conftest's ULYSSES_TEST_SEED), reproducible when that is set."""
    from conftest import BASE_SEED

    return zlib.crc32(name.encode()) ^ BASE_SEED


def _segment_ids(rng, b, s):
    """Packed documents of random lengths (3-6 per row), so documents cross block boundaries."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=rng.integers(2, 6), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(s), side="right") + 7)  # ids need not start at 0
    return jnp.asarray(np.stack(rows), jnp.int32)


def _inputs(case: Case):
    rng = np.random.default_rng(_seed(case.id))

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(case.dtype)

    q, k, v = normal(case.b, case.s, case.h, case.d), *(normal(case.b, case.s, case.hkv, case.d) for _ in "kv")
    do = normal(case.b, case.s, case.h, case.d)
    seg = _segment_ids(rng, case.b, case.s) if case.segments else None
    return q, k, v, do, seg


def _fwd_bwd(attn, q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(do))


# --------------------------------------------------------------------------------- correctness


# The default suite keeps eight of the cases: every head layout, mask, dtype and tiling (even, mixed, default, an odd
# length) and the scale; `make test-slow` the other seven, which repeat them in other combinations.
DEFAULT_CASES = {"gqa-f32-d16-s128-mixedA-causal", "seg-gqa-f32-d16-s96-mixedB-full",
                 "odd-seg-mqa-f32-d16-s37-b16-full", "odd-seg-gqa-f32-d16-s37-mixedA-causal",
                 "bf16-seg-mha-d64-s100-b32-full", "bf16-gqa-d128-s64-b32-full", "default-blocks-f32-d64-s64-causal",
                 "d24-scale0.3-f32-s64-b16-causal"}


def test_default_cases_exist():
    assert DEFAULT_CASES <= {c.id for c in CASES}


@pytest.mark.parametrize("case", [c if c.id in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES], ids=lambda c: c.id)
def test_matches_reference_and_float64(case):
    q, k, v, do, seg = _inputs(case)
    kw = dict(causal=case.causal, segment_ids=seg, scale=case.scale)
    flash = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, block_sizes=case.block_sizes, **kw),
                                        *a))
    ref = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: reference(q, k, v, **kw), *a))
    got, want_jnp = flash(q, k, v, do), ref(q, k, v, do)
    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.d)
    want_np = attention_np(q, k, v, do, causal=case.causal, segment_ids=seg, scale=scale)
    tol = TOL[case.dtype]
    for name, x, wj, wn in zip(("out", "dq", "dk", "dv"), got, want_jnp, want_np):
        assert x.dtype == case.dtype and x.shape == wn.shape, name
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        assert rel_err(x, wn) < tol, (name, "vs float64", rel_err(x, wn))
        assert rel_err(x, wj) < tol, (name, "vs reference", rel_err(x, wj))


def test_eager_equals_jit():
    case = CASES[4]
    q, k, v, do, seg = _inputs(case)

    def attn(q, k, v):
        return flash_attention(q, k, v, segment_ids=seg, block_sizes=case.block_sizes)

    eager, jitted = _fwd_bwd(attn, q, k, v, do), jax.jit(lambda *a: _fwd_bwd(attn, *a))(q, k, v, do)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_inside_shard_map():
    """Batch-sharded over every device (1 or 8 fake CPU devices): same values as unsharded."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    case = Case("shard-map", 64, 2, 1, 16, segments=True, blocks=_blocks(32), b=n)
    q, k, v, do, seg = _inputs(case)

    def attn(q, k, v, seg):
        return flash_attention(q, k, v, segment_ids=seg, block_sizes=case.block_sizes)

    sharded = jax.shard_map(attn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    got = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: sharded(q, k, v, seg), *a))(q, k, v, do)
    want = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: attn(q, k, v, seg), *a))(q, k, v, do)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- causal block skipping


@pytest.mark.parametrize("bq,bk,seq_len", [(16, 16, 64), (32, 16, 100), (16, 32, 100), (64, 16, 37)],
                         ids=lambda x: str(x))
def test_loop_bounds_visit_exactly_the_blocks_with_a_visible_key(bq, bk, seq_len):
    s_pad = -(-seq_len // max(bq, bk)) * max(bq, bk)
    for qi in range(s_pad // bq):  # forward and dQ: KV blocks [0, bound) for a query block
        rows = np.arange(qi * bq, (qi + 1) * bq)
        needed = {kj for kj in range(s_pad // bk) for c in range(kj * bk, (kj + 1) * bk)
                  if c < seq_len and c <= rows.max()}
        assert set(range(int(kv_block_bound(qi, block_q=bq, block_k=bk, seq_len=seq_len, causal=True)))) == needed
    for kj in range(s_pad // bk):  # dK/dV: query blocks [lo, hi) for a KV block
        cols = np.arange(kj * bk, (kj + 1) * bk)
        needed = {qi for qi in range(s_pad // bq) for r in range(qi * bq, (qi + 1) * bq)
                  if r < seq_len and cols.min() < seq_len and r >= cols.min()}
        lo, hi = q_block_range(kj, block_q=bq, block_k=bk, seq_len=seq_len, causal=True)
        assert set(range(int(lo), int(hi))) == needed
    # Causal visits n(n+1)/2 of n^2 blocks when block_q == block_k.
    n = 1024 // 128
    trips = sum(int(kv_block_bound(i, block_q=128, block_k=128, seq_len=1024, causal=True)) for i in range(n))
    assert trips == n * (n + 1) // 2


def test_causal_kernels_skip_future_blocks():
    """Poison what a skipped block would read with NaN: a visited-but-masked block gives 0 * NaN = NaN."""
    b, s, h, d, blk = 1, 64, 2, 16, 16
    rng = np.random.default_rng(_seed("poison"))
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(4))
    kw = dict(causal=True, block_sizes=BlockSizes(*_blocks(blk)))

    # Forward and dQ of the first query block never read keys/values past it.
    k_bad, v_bad = k.at[:, blk:].set(jnp.nan), v.at[:, blk:].set(jnp.nan)
    out, dq, _, _ = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **kw), q, k_bad, v_bad, do)
    want_out, want_dq, _, _ = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v, do)
    np.testing.assert_allclose(out[:, :blk], want_out[:, :blk], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dq[:, :blk], want_dq[:, :blk], rtol=1e-6, atol=1e-6)

    # dK/dV of the last KV block never read queries / output gradients before it.
    q_bad, do_bad = q.at[:, : s - blk].set(jnp.nan), do.at[:, : s - blk].set(jnp.nan)
    _, _, dk, dv = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **kw), q_bad, k, v, do_bad)
    _, _, want_dk, want_dv = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **kw), q, k, v,
                                      do.at[:, : s - blk].set(0.0))
    np.testing.assert_allclose(dk[:, s - blk:], want_dk[:, s - blk:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dv[:, s - blk:], want_dv[:, s - blk:], rtol=1e-6, atol=1e-6)

    # Sanity of the method: without causal skipping the poison does reach the first block.
    out_full = flash_attention(q, k_bad, v_bad, causal=False, block_sizes=kw["block_sizes"])
    assert np.all(np.isnan(out_full[:, :blk]))


# --------------------------------------------------------------------------------- memory


def _avals(jaxpr):
    """Every variable's abstract value in a jaxpr and all jaxprs nested in its equations."""
    for v in jaxpr.invars:
        yield v.aval
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _avals(sub)


def _largest_square(fn, *args, s):
    """Largest number of dims >= s in any array of the traced gradient (2 means an [S, S] array)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(*args)
    return max(sum(dim >= s for dim in getattr(a, "shape", ())) for a in _avals(jaxpr.jaxpr))


def test_no_seq_by_seq_array_in_gradient():
    b, s, h, d = 1, 256, 2, 16
    rng = np.random.default_rng(_seed("memory"))
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.arange(4), s // 4)[None], jnp.int32)
    kw = dict(causal=True, segment_ids=seg)
    blocks = BlockSizes(*_blocks(32))
    assert _largest_square(lambda *a: flash_attention(*a, block_sizes=blocks, **kw), q, k, v, s=s) == 1
    assert _largest_square(lambda *a: reference(*a, **kw), q, k, v, s=s) == 2  # the check can see one


# --------------------------------------------------------------------------------- API


def test_validation_errors():
    x = jnp.zeros((1, 32, 3, 16))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be divisible by kv heads \(2\)"):
        flash_attention(x, jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)))
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(x, x, x, block_sizes=BlockSizes(block_q=24))
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        flash_attention(x, x, x, segment_ids=jnp.zeros((1, 31), jnp.int32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_interpret_is_chosen_at_call_time():
    x = jnp.ones((1, 16, 1, 16))
    assert np.all(np.isfinite(flash_attention(x, x, x)))  # interpret=None -> interpret mode on CPU
    with pytest.raises(Exception, match="interpret"):  # compiled Pallas has no CPU lowering
        jax.block_until_ready(flash_attention(x, x, x, interpret=False))


# --------------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("case", [
    Case("mha-bf16-d128-s1024-causal", 1024, 4, 4, 128, jnp.bfloat16),
    Case("gqa3-seg-f32-d40-s1100-full", 1100, 6, 2, 40, causal=False, segments=True, blocks=MIXED_A),
], ids=lambda c: c.id)
def test_lowers_to_triton_for_cuda(case):
    """Without a GPU: lower forward + backward for the CUDA platform. This runs the Pallas -> Triton IR
    lowering (power-of-two tiles, ref indexing, loops) and checks that all three kernels became Triton
    calls: jax >= 0.10 would send a pallas_call without Triton compiler params to Mosaic GPU."""
    q = jax.ShapeDtypeStruct((case.b, case.s, case.h, case.d), case.dtype)
    kv = jax.ShapeDtypeStruct((case.b, case.s, case.hkv, case.d), case.dtype)
    seg = jax.ShapeDtypeStruct((case.b, case.s), jnp.int32) if case.segments else None

    def attn_and_grads(q, k, v, seg):
        return _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, causal=case.causal, segment_ids=seg,
                                                        block_sizes=case.block_sizes, interpret=False), q, k, v, q)

    text = jax.jit(attn_and_grads).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton(") == 3



@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("s", [8192, 16384, 32768], ids=lambda s: f"s{s}")
def test_gpu_long_sequences_bf16_d128(s, causal):
    """Compiled (Triton) kernels vs the float32-softmax reference; the reference holds a few [H, S, S]
    float32 arrays (8.6 GB each at S=32K with H=2), so keep B=1, H=2, Hkv=1."""
    case = Case(f"gpu-s{s}-{causal}", s, 2, 1, 128, jnp.bfloat16, causal=causal, b=1)
    q, k, v, do, _ = _inputs(case)
    got = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, causal=causal), *a))(q, k, v, do)
    want = jax.jit(lambda *a: _fwd_bwd(lambda q, k, v: reference(q, k, v, causal=causal), *a))(q, k, v, do)
    for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        assert rel_err(x, w) < TOL[jnp.bfloat16], (name, rel_err(x, w))
