"""The gated delta rule's Pallas walk over chunks (``kernels/gated_delta_scan.py``; ``gated_delta_rule(impl="pallas")``
in the kernels and the model).

On the CPU the kernels run in Pallas' interpret mode: their forward and backward against the ``lax.scan`` of
``gated_delta._step`` and its autodiff vjp (fresh random parts, float32 and float64), the whole rule against the
token-by-token recurrence in float64 (packed documents, two value heads per key head, a length that is not a multiple
of the blocks), the bf16 products against the float32 recurrence, and the refusals. Compiled for a compile-only H100
(``aot``): both kernels are Triton kernels whose products are all Hopper ``wgmma``; ptxas' spills as recorded in
``ScanBlocks``' docstring (none with bf16 products, at most 692 B per thread with float32 ones). Timed on a GPU: not yet
(``experiments/bench_delta.py --impl pallas``; ``tests/test_gpu.py`` compares it with the XLA walk there).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ulysses_jax.kernels import gated_delta
from ulysses_jax.kernels.gated_delta import gated_delta_rule
from ulysses_jax.kernels.gated_delta_reference import gated_delta_recurrent
from ulysses_jax.kernels.gated_delta_scan import ScanBlocks, scan_backward, scan_forward
from test_gated_delta import B, DV, HV, S, inputs  # noqa: I001 - the tests' own helpers

@contextlib.contextmanager
def enable_x64(on: bool = True):
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def x64():
    with enable_x64():
        yield


def parts(seed, m=3, h=3, c=16, dk=32, dv=32, dtype=np.float64):
    """A block's parts as ``gated_delta._intra`` shapes them, random: ``(state, (u, w, a, qg, kd, gam_last))``."""
    r = np.random.default_rng(seed)
    u = r.normal(size=(m, h, c, dv))
    w, qg, kd = (0.2 * r.normal(size=(m, h, c, dk)) for _ in range(3))
    a = np.tril(0.2 * r.normal(size=(m, h, c, c)))
    gl = r.uniform(0.3, 1.0, size=(m, h))
    state = r.normal(size=(h, dk, dv))
    return jnp.asarray(state, dtype), tuple(jnp.asarray(x, dtype) for x in (u, w, a, qg, kd, gl))


def close(a, b, rtol, atol_frac):
    """``|a - b| <= rtol |b| + atol_frac max|b|`` elementwise."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * np.abs(b).max())


@pytest.mark.parametrize("dtype,block_v,tol", [(np.float64, 16, 1e-12), (np.float64, 32, 1e-12),
                                               (np.float32, 16, 1e-5)])
def test_kernels_walk_as_the_lax_scan(dtype, block_v, tol):
    """Forward: the state after the block, each output and each chunk's incoming state; backward: the gradients of
    the incoming state and of all six parts, against ``jax.vjp`` of the ``lax.scan`` the XLA path runs. Two column
    blocks per head at ``block_v = 16`` (the parts' column sums are XLA's, after the kernel)."""
    with enable_x64(dtype == np.float64):
        state, ps = parts(1, dtype=dtype)
        (ref_state, ref_o), vjp = jax.vjp(lambda s, p: lax.scan(gated_delta._step, s, p), state, ps)
        blocks = ScanBlocks(block_v=block_v)
        new, o, kept = scan_forward(state, ps, keep_states=True, blocks=blocks)
        close(new, ref_state, tol, tol)
        close(o, ref_o, tol, tol)
        ref_kept = lax.scan(lambda st, p: (gated_delta._step(st, p)[0], st), state, ps)[1]
        close(kept, ref_kept, tol, tol)
        r = np.random.default_rng(7)
        d_out, do = jnp.asarray(r.normal(size=state.shape), dtype), jnp.asarray(r.normal(size=o.shape), dtype)
        ref_d_state, ref_d_parts = vjp((d_out, do))
        d_state, d_parts = scan_backward(kept, ps, do, d_out, blocks=blocks)
        close(d_state, ref_d_state, tol, tol)
        for got, want in zip(d_parts, ref_d_parts):
            assert got.shape == want.shape and got.dtype == want.dtype
            close(got, want, tol, tol)
        assert scan_forward(state, ps, output=False, blocks=blocks)[1] is None


def _run(impl, args, seg, cotangent, **kw):
    def f(*a):
        return gated_delta_rule(*a, segment_ids=seg, block=2, impl=impl, **kw)

    o, vjp = jax.vjp(f, *args)
    return jax.tree.map(np.asarray, (o, vjp(cotangent.astype(o.dtype))))


def test_pallas_rule_equals_the_recurrence_in_float64(x64):
    """Outputs and the gradients of q, k, v, g, beta; three documents in one row (a boundary mid-chunk, one across
    the two blocks), 200 tokens in blocks of two 64-token chunks (padded), two value heads per key head; and equal to
    the XLA walk up to float64 rounding. The Pallas path is really taken: its program holds the three kernels."""
    args = inputs(3)
    seg = jnp.asarray([[1] * 70 + [2] * 58 + [3] * 72, [4] * 200])
    ct = jnp.asarray(np.random.default_rng(9).normal(size=(B, S, HV, DV)))
    o, d = _run("pallas", args, seg, ct)
    o_ref, d_ref = jax.tree.map(np.asarray, jax.vjp(lambda *a: gated_delta_recurrent(*a, segment_ids=seg), *args))
    d_ref = jax.tree.map(np.asarray, jax.vjp(lambda *a: gated_delta_recurrent(*a, segment_ids=seg), *args)[1](ct))
    close(o, o_ref, 1e-10, 1e-12)
    for x, y in zip(d, d_ref):
        close(x, y, 1e-9, 1e-11)
    o_x, d_x = _run("xla", args, seg, ct)
    close(o, o_x, 1e-12, 1e-13)
    for x, y in zip(d, d_x):
        close(x, y, 1e-11, 1e-12)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: gated_delta_rule(q, *args[1:], impl="pallas").sum()))(args[0]))
    assert jaxpr.count("pallas_call") == 3  # the forward, the backward's recomputed states, the backward


@pytest.mark.slow  # 18 s; the XLA walk's bf16 products stay in the default suite (test_gated_delta.py)
def test_pallas_bf16_products_stay_near_the_float32_recurrence():
    """``precision="bf16"`` through the kernels: within the same bounds as the XLA walk's bf16 products
    (``test_gated_delta.py``), and visibly not float32 products (not a no-op)."""
    args = inputs(6, dtype=np.float32)
    seg = jnp.asarray([[1] * 120 + [2] * 80, [3] * 200])
    ct = jnp.asarray(np.random.default_rng(99).normal(size=(B, S, HV, DV)), jnp.float32)
    o_ref, vjp = jax.vjp(lambda *a: gated_delta_recurrent(*a, segment_ids=seg), *args)
    d_ref = vjp(ct)
    o, d = _run("pallas", args, seg, ct, precision="bf16")
    o_hi, _ = _run("pallas", args, seg, ct)
    close(o, o_ref, 1e-2, 1.5e-2)
    for x, y in zip(d, d_ref):
        close(x, y, 1e-2, 1.5e-2)
    assert np.abs(o - np.asarray(o_ref)).max() > 100 * np.abs(o_hi - np.asarray(o_ref)).max()


def test_refusals_name_the_value_and_the_fix():
    args = inputs(0, dtype=np.float32)
    with pytest.raises(ValueError, match=r"impl 'triton' is not one of 'xla', 'pallas'"):
        gated_delta_rule(*args, impl="triton")
    with pytest.raises(ValueError, match=r"needs chunk a power of two >= 16, got 48; use impl='xla'"):
        gated_delta_rule(*args, impl="pallas", chunk=48)
    with pytest.raises(ValueError, match=r"block_v 24 must be a power of two >= 16 dividing dv = 32"):
        gated_delta_rule(*args, impl="pallas", scan_blocks=ScanBlocks(block_v=24))
    with enable_x64(True):
        args64 = inputs(0)
        with pytest.raises(ValueError, match=r"float64 inputs need impl='xla'"):
            gated_delta_rule(*args64, impl="pallas", interpret=False)


@pytest.mark.aot
@pytest.mark.parametrize("low,max_spill", [pytest.param(True, 0, marks=pytest.mark.slow), (False, 692)])
def test_kernels_compile_for_an_h100_as_wgmma(tmp_path, low, max_spill):
    """The whole rule's forward and backward at Qwen3.5's head shape (dk = dv = 128, chunks of 64) built for a
    compile-only H100: three Triton kernels (the forward walk, again without outputs for the chunk states; the backward
    walk), every
    product a Hopper ``wgmma`` (no ``mma.sync``), spills as recorded (``ScanBlocks``)."""
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.plan.kernel_report import dump_options, kernels
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)[0]
    sh = SingleDeviceSharding(dev)
    b, s, hk, hv, d = 1, 8192, 2, 4, 128
    structs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)
               for shape in ((b, s, hk, d), (b, s, hk, d), (b, s, hv, d))]
    structs += [jax.ShapeDtypeStruct((b, s, hv), jnp.float32, sharding=sh)] * 2

    def loss(q, k, v, g, beta):
        o = gated_delta_rule(q, k, v, g, beta, impl="pallas", interpret=False, precision="bf16" if low else "highest")
        return o.astype(jnp.float32).sum()

    with jax.default_device(dev):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*structs).lower()
    lowered.compile(compiler_options=dump_options(tmp_path))
    found = kernels(tmp_path, prefix="gated_delta_scan")
    assert sorted(k.name for k in found) == ["gated_delta_scan_bwd", "gated_delta_scan_fwd", "gated_delta_scan_states"]
    report = [(k.name, k.warps, k.registers, k.spill_store_bytes, k.wgmma, k.mma_sync) for k in found]
    print(report)
    for k in found:
        assert k.wgmma > 0 and k.mma_sync == 0, report
        assert k.spill_store_bytes <= max_spill, report
