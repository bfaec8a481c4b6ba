"""Grouped matmul (kernels/grouped_matmul.py) vs an independent float64 NumPy loop over groups and vs the jnp reference.

On CPU the Pallas kernels run in interpret mode (``impl="pallas"``); ``impl="ragged_dot"`` is ``jax.lax.ragged_dot``.
Small tiles (32 rows) make groups straddle tiles, leave tiles with several groups, and leave rows past the total.
The compile-only H100 test (marker ``aot``) compiles forward + backward at MoE size and reads the program: three Triton
kernels, wgmma, no spill, and none of the dense ``[M, E * N]`` temp that ``ragged_dot`` needs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.grouped_matmul import (
    BlockSizes,
    group_bounds,
    grouped_matmul,
    grouped_matmul_reference,
    num_visits,
    visits,
)

# Tolerances on max|got - expected| / max|expected| against float64. float32: exact products (no TF32), measured
# ~1e-7. bfloat16: the output / gradient is rounded to bf16 (2^-8 relative), the inputs are the same bf16 values.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SMALL = BlockSizes(32, 16, 16, 16, 32, 16, num_warps=(4, 4), num_stages=(2, 2))
M, K, N, E = 200, 32, 48, 6  # M not a multiple of 32: the padded path


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def numpy_f64(x, w, gs, dy, transpose_rhs):
    """out, dx, dw by a float64 loop over groups (rows past the total: out 0, dx 0)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    out, dx, dw = np.zeros((x.shape[0], dy.shape[1])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        r = slice(start, min(start + int(size), x.shape[0]))
        we = w[e].T if transpose_rhs else w[e]  # [K, N]
        out[r] = x[r] @ we
        dx[r] = dy[r] @ we.T
        dwe = x[r].T @ dy[r]
        dw[e] = dwe.T if transpose_rhs else dwe
        start += int(size)
    return out, dx, dw


def inputs(seed, dtype, transpose_rhs, gs, m=M):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, K)), dtype)
    w = jnp.asarray(rng.standard_normal((E, N, K) if transpose_rhs else (E, K, N)) / np.sqrt(K), dtype)
    dy = jnp.asarray(rng.standard_normal((m, N)), dtype)
    return x, w, jnp.asarray(gs, jnp.int32), dy


def random_sizes(seed, total, e=E, empty=2):
    """Random group sizes summing to ``total`` with ``empty`` of them zero."""
    rng = np.random.default_rng(seed + 1)
    cuts = np.sort(rng.integers(0, total + 1, e - empty - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes = np.concatenate([sizes, np.zeros(empty, int)])
    return rng.permutation(sizes)


def run(x, w, gs, dy, **kw):
    """(out, dx, dw) of one grouped_matmul, forward and vjp in one jit."""
    @jax.jit
    def f(x, w, gs, dy):
        out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, **kw), x, w)
        return (out, *vjp(dy))

    return f(x, w, gs, dy)


def check(got, x, w, gs, dy, transpose_rhs, dtype):
    want = numpy_f64(x, w, gs, dy, transpose_rhs)
    for name, g, wv in zip(("out", "dx", "dw"), got, want):
        assert g.dtype == dtype, (name, g.dtype)
        assert rel_err(g, wv) < TOL[dtype], (name, rel_err(g, wv))


# ------------------------------------------------------------------------------------------------ metadata


@pytest.mark.parametrize("m,bm", [(200, 32), (256, 64), (16, 16)])
def test_visits_cover_every_row_once(seed, m, bm):
    """Each row of [0, m) lies in exactly one used visit, in its own group (E for rows past the total); the list
    fits its static length."""
    rng = np.random.default_rng(seed)
    listed = jax.jit(lambda gs: visits(group_bounds(gs, m), m, bm))
    for _ in range(20):
        sizes = random_sizes(int(rng.integers(2**31)), int(rng.integers(0, m + 1)), empty=int(rng.integers(0, 4)))
        vis = np.asarray(listed(jnp.asarray(sizes, jnp.int32)))
        assert vis.shape == (4, num_visits(m, E, bm))
        owner = np.full(m, -1)
        for g, tile, lo, hi in vis.T:
            if hi > lo:
                assert tile * bm <= lo and hi <= (tile + 1) * bm
                assert (owner[lo:hi] == -1).all()
                owner[lo:hi] = g
        expected = np.concatenate([np.repeat(np.arange(E), sizes), np.full(m - sizes.sum(), E)])
        np.testing.assert_array_equal(owner, expected)


# ------------------------------------------------------------------------------------------------ values


CASES = [pytest.param(impl, t, dtype, id=f"{impl}-{'wT' if t else 'w'}-{name}",
                      marks=[pytest.mark.slow] if (impl, t, name) == ("pallas", True, "bf16") else [])
         for impl in ("pallas", "ragged_dot") for t in (False, True)
         for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))]


@pytest.mark.parametrize("impl,transpose_rhs,dtype", CASES)  # pallas-wT-bf16 is slow: wT-f32 and w-bf16 cover it
def test_matches_float64(seed, impl, transpose_rhs, dtype):
    """Output, dX and dW: random sizes with two empty groups and rows past the total (190 of 200 rows used)."""
    x, w, gs, dy = inputs(seed, dtype, transpose_rhs, random_sizes(seed, M - 10))
    got = run(x, w, gs, dy, transpose_rhs=transpose_rhs, impl=impl, block_sizes=SMALL)
    check(got, x, w, gs, dy, transpose_rhs, dtype)
    assert not np.asarray(got[0][M - 10:], np.float32).any() and not np.asarray(got[1][M - 10:], np.float32).any()


def test_group_layouts_one_compile(seed):
    """One jitted pallas call (group sizes are traced), layouts that stress the visit list: one group owning every
    row, every group empty, groups of one row, a group straddling three tiles, sizes summing past M (clamped)."""
    x, w, _, dy = inputs(seed, jnp.float32, False, [0] * E)
    f = jax.jit(lambda x, w, gs, dy: run(x, w, gs, dy, impl="pallas", block_sizes=SMALL))
    layouts = {"one-group": [0, 0, M, 0, 0, 0], "all-empty": [0] * E, "ones": [1, 1, 1, 1, 1, 1],
               "straddles": [5, 90, 0, 33, 31, 41], "over-m": [60, 60, 60, 60, 0, 0]}
    for name, sizes in layouts.items():
        gs = jnp.asarray(sizes, jnp.int32)
        got = f(x, w, gs, dy)
        clamped = np.diff(np.minimum(np.cumsum([0, *sizes]), M))
        want = numpy_f64(x, w, clamped, dy, False)
        for what, g, wv in zip(("out", "dx", "dw"), got, want):
            assert np.abs(np.asarray(g) - wv).max() <= 1e-5 * max(1.0, np.abs(wv).max()), (name, what)


def test_fewer_rows_than_a_tile_and_none(seed):
    """5 rows (one 16-row tile after fitting, padded) and 0 rows, default blocks."""
    for m, sizes in ((5, [2, 0, 2, 0, 1, 0]), (0, [0] * E)):
        x, w, gs, dy = inputs(seed, jnp.float32, False, sizes, m=m)
        got = run(x, w, gs, dy, impl="pallas")
        for g, want in zip(got, numpy_f64(x, w, gs, dy, False)):
            assert g.shape == want.shape and np.allclose(g, want, atol=1e-5), m


def test_reference_and_preferred_element_type(seed):
    """The jnp reference agrees with float64; ``preferred_element_type=float32`` on bf16 inputs returns float32 (and
    float32 gradients do not lose the bf16 weights' dtype)."""
    x, w, gs, dy = inputs(seed, jnp.bfloat16, False, random_sizes(seed, M - 7))
    ref = grouped_matmul_reference(x, w, gs)
    assert ref.dtype == jnp.bfloat16 and rel_err(ref, numpy_f64(x, w, gs, dy, False)[0]) < TOL[jnp.bfloat16]
    for impl in ("pallas", "ragged_dot"):
        out, dx, dw = run(x, w, gs, dy.astype(jnp.float32), impl=impl, block_sizes=SMALL,
                          preferred_element_type=jnp.float32)
        assert (out.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16), impl
        want = numpy_f64(x, w, gs, dy.astype(jnp.float32), False)
        assert rel_err(out, want[0]) < 1e-5, impl  # float32 accumulation, no bf16 rounding of the output


def test_inside_shard_map_on_8_devices(seed):
    """Jitted inside shard_map: each of 8 CPU devices multiplies its own tokens with its own group sizes."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    m_local = 64
    sizes = np.stack([random_sizes(seed + i, m_local - i) for i in range(8)])  # device i leaves i rows unused
    x, w, _, dy = inputs(seed, jnp.float32, False, sizes[0], m=8 * m_local)
    gs = jnp.asarray(sizes, jnp.int32)

    def local(x, w, gs, dy):
        out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs[0], impl="pallas", block_sizes=SMALL), x, w)
        dx, dw = vjp(dy)
        return out, dx, jax.lax.psum(dw, "x")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")),
                              out_specs=(P("x"), P("x"), P()), check_vma=False))
    out, dx, dw = f(x, w, gs, dy)
    dw_want = 0
    for i in range(8):
        r = slice(i * m_local, (i + 1) * m_local)
        want = numpy_f64(x[r], w, sizes[i], dy[r], False)
        assert rel_err(out[r], want[0]) < 1e-5 and rel_err(dx[r], want[1]) < 1e-5, i
        dw_want = dw_want + want[2]
    assert rel_err(dw, dw_want) < 1e-5


# ------------------------------------------------------------------------------------------------ choices, errors


def test_impl_choice():
    """auto is ragged_dot on CPU and pallas on GPU devices (``platform="gpu"``, here still interpreted)."""
    x, w, gs, _ = inputs(0, jnp.float32, False, [M, 0, 0, 0, 0, 0])

    def prims(**kw):
        return str(jax.make_jaxpr(lambda x, w, gs: grouped_matmul(x, w, gs, **kw))(x, w, gs))

    assert "ragged_dot" in prims() and "pallas_call" not in prims()
    assert "pallas_call" in prims(platform="gpu", interpret=True, block_sizes=SMALL)
    assert "pallas_call" in prims(impl="pallas", block_sizes=SMALL)
    with pytest.raises(ValueError, match="impl='cublas' is unknown: choose one of auto, pallas, ragged_dot"):
        grouped_matmul(x, w, gs, impl="cublas")


def test_errors_name_the_value():
    x, w, gs, _ = inputs(0, jnp.float32, False, [M, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="dimension 40 .* not a multiple of 16"):
        grouped_matmul(x, w[:, :, :40], gs, impl="pallas")
    with pytest.raises(ValueError, match="block_m=48 must be a power of two"):
        grouped_matmul(x, w, gs, impl="pallas", block_sizes=BlockSizes(block_m=48))
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        grouped_matmul(x, w, gs, transpose_rhs=True)
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        grouped_matmul(x, w, gs.astype(jnp.float32))


# ------------------------------------------------------------------------------------------------ H100 (compile only)


@pytest.mark.aot
def test_h100_compiles_real_grouped_kernels(tmp_path):
    """MoE size, bf16, forward + backward for a compile-only H100: three Triton kernels (forward, dX, dW), every
    product a wgmma, no spill, and temp memory far below the dense [M, E * N] operand that ragged_dot builds."""
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.plan.kernel_report import dump_options, kernels
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)[0]
    m, k, n, e = 65536, 2048, 768, 128
    sh = SingleDeviceSharding(dev)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sh))

    def loss(x, w, gs):
        return grouped_matmul(x, w, gs, platform="gpu").astype(jnp.float32).sum()

    with jax.default_device(dev):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower()
    compiled = lowered.compile(compiler_options=dump_options(tmp_path))
    assert compiled.as_text().count("__gpu$xla.gpu.triton") == 3
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < m * e * n * 2 / 64, temp  # the dense operand would be 12 GiB; the output y is 96 MiB
    found = kernels(tmp_path, prefix="grouped_matmul")
    assert {k.name for k in found} == {"grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw"}, found
    for kern in found:
        assert kern.wgmma > 0 and kern.mma_sync == 0, kern
        assert (kern.spill_store_bytes, kern.spill_load_bytes) == (0, 0), kern


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w", "wT"])
def test_gpu_kernels_match_float64(seed, transpose_rhs):
    """On a real GPU: the compiled Triton kernels (default bf16 tiles) at a small MoE shape, against float64."""
    m = 4096 + 77  # not a tile multiple: the padded path
    rng = np.random.default_rng(seed)
    sizes = random_sizes(seed, m - 50, e=32, empty=3)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 512, 256) if transpose_rhs else (32, 256, 512)) / 16, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
    got = run(x, w, jnp.asarray(sizes, jnp.int32), dy, transpose_rhs=transpose_rhs, impl="auto")
    check(got, x, w, sizes, dy, transpose_rhs, jnp.bfloat16)
