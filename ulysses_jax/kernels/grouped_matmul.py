"""Grouped matmul for mixture-of-experts in Pallas (Triton lowering): forward, dX and dW kernels, differentiable.

``grouped_matmul(x [M, K], w [E, K, N], group_sizes [E])`` multiplies each group of consecutive rows of ``x`` by its
own matrix: rows ``[sum(gs[:e]), sum(gs[:e+1]))`` by ``w[e]`` (``transpose_rhs``: by ``w[e].T``, ``w`` being
``[E, N, K]``); rows past ``sum(gs)`` give 0. The semantics of ``jax.lax.ragged_dot``, which in jax 0.10.2 is no
grouped GEMM on GPU: XLA turns it into one dense GEMM over a masked ``[M, E * N]`` operand (E times the work, and at
MoE sizes tens of GiB of temp memory). ``group_sizes`` is traced (data dependent); shapes are static.

Kernels (float32 accumulators throughout):
  gmm   grid (visits, N tiles). A *visit* is one (row tile, group) pair: a tile of ``block_m`` rows that straddles
        group boundaries is visited once per group it touches, so a static list of ``cdiv(M, block_m) + E`` visits
        (:func:`visits`, computed in jnp from ``group_sizes``) covers every row, the rows past the total included
        (a last pseudo-group that writes zeros). Each program reads its visit (group, tile, row range) from that
        list, loops over K in ``block_k`` chunks loading ``w[group]`` at a data-dependent offset, and stores the
        rows of its group only (masked store). Unused visits do nothing. Used for the forward and for dX.
  tgmm  grid (E, P tiles, Q tiles): ``out[e] = a_e^T @ b_e`` summed over group e's rows, a loop with a
        data-dependent trip count over the row tiles the group touches (masked loads); empty groups give 0.
        dW is ``tgmm(x, dy)`` (``[E, K, N]``) or with ``transpose_rhs`` ``tgmm(dy, x)`` (``[E, N, K]``): no
        transposed copy of ``w`` exists. dX is ``gmm(dy, w, transpose_rhs=not transpose_rhs)``.

On GPU the Triton compiler params are passed explicitly (without them jax >= 0.10 routes a ``pallas_call`` to Mosaic
GPU); elsewhere the same kernels run in Pallas interpret mode. ``M`` is padded with zero rows to a multiple of
``block_m`` when it is not one (a copy of ``x``); ``K`` and ``N`` must be multiples of 16 (Triton's dot needs tiles of
at least 16). Row offsets stay in int32: per-device ``x`` up to 2^31 elements.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ulysses_jax.kernels.attention import device_platform

IMPLS = ("auto", "pallas", "ragged_dot")
MIN_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles (powers of two >= 16) and launch settings of the two kernels; larger than a dimension, they shrink.

    gmm (forward and dX): ``block_m`` rows x ``block_n`` columns of output, K streamed in ``block_k`` chunks.
    tgmm (dW): ``tgmm_block_p`` x ``tgmm_block_q`` of ``out[e]``, the group's rows streamed ``tgmm_block_m`` at a time.
    ``num_warps`` / ``num_stages``: ``(gmm, tgmm)``, GPU only.
    """

    block_m: int = 128
    block_k: int = 64
    block_n: int = 256
    tgmm_block_m: int = 64
    tgmm_block_p: int = 128
    tgmm_block_q: int = 256
    num_warps: tuple[int, int] = (8, 8)
    num_stages: tuple[int, int] = (3, 3)


def default_block_sizes(dtype) -> BlockSizes:
    """16-bit inputs: the class defaults, Triton's usual Hopper GEMM tile (128 x 256, K by 64, 8 warps, 3 stages).
    Compiled for an H100 (experiments/grouped_matmul_aot.py) every product of all three kernels is a wgmma
    (m64n256k16), 147,456 B shared memory, 170-176 registers, no spill; chosen from those figures, not timed.
    float32: exact products (no TF32), which Triton issues as FMAs, not tensor-core MMAs: small tiles, 4 warps."""
    if jnp.dtype(dtype).itemsize <= 2:
        return BlockSizes()
    return BlockSizes(64, 32, 64, 32, 64, 64, num_warps=(4, 4), num_stages=(2, 2))


def _fit(block: int, dim: int, name: str, *, divide: bool) -> int:
    """``block`` shrunk to the dimension (and, with ``divide``, to a power of two dividing it)."""
    if block < MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two >= {MIN_BLOCK}: pass other BlockSizes")
    block = min(block, max(MIN_BLOCK, 1 << max(0, (dim - 1).bit_length())))
    while divide and dim % block and block > MIN_BLOCK:
        block //= 2
    if divide and dim % block:
        raise ValueError(f"dimension {dim} (tiled by {name}) is not a multiple of {MIN_BLOCK}: pad it to one "
                         f"with zeros (the Triton dot needs tiles of at least {MIN_BLOCK})")
    return block


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff argument)."""

    transpose_rhs: bool
    out_dtype: str  # dtype name of the forward output
    blocks: BlockSizes  # block_m fitted to M; the kernels fit the other tiles to their operands
    interpret: bool


# ---------------------------------------------------------------------------------------------------
# Group metadata (jnp, outside the kernels)
# ---------------------------------------------------------------------------------------------------


def group_bounds(group_sizes, m: int):
    """``[2, E + 1]`` int32: first and one-past-last row of each group, then of the rows past the total (clamped
    to ``m``; a total over ``m`` leaves later groups short or empty)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return jnp.stack([starts, ends])


def num_visits(m: int, e: int, block_m: int) -> int:
    """The static length of the visit list: each of the ``cdiv(m, block_m)`` tiles once, plus one per group
    boundary that falls inside a tile (at most ``e`` of them, counting the boundary before the rows past the total)."""
    return pl.cdiv(m, block_m) + e


def visits(bounds, m: int, block_m: int):
    """``[4, V]`` int32 visit list of the gmm kernel: rows (group, row tile, first row, one-past-last row).

    Visits are ordered by group, then tile; unused ones (past the last) have an empty row range. Group ``E``
    stands for the rows past ``sum(group_sizes)``, which the kernel fills with zeros.
    """
    e1 = bounds.shape[1]
    starts, ends = bounds[0], bounds[1]
    first = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    offsets = jnp.cumsum(count)
    v = jnp.arange(num_visits(m, e1 - 1, block_m), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(offsets, v, side="right"), e1 - 1).astype(jnp.int32)
    used = v < offsets[-1]
    tile = first[group] + v - (offsets[group] - count[group])
    lo = jnp.maximum(starts[group], tile * block_m)
    hi = jnp.minimum(ends[group], (tile + 1) * block_m)
    return jnp.stack([group, jnp.where(used, tile, 0), jnp.where(used, lo, 0), jnp.where(used, hi, 0)])


# ---------------------------------------------------------------------------------------------------
# Pieces shared by the kernels
# ---------------------------------------------------------------------------------------------------


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with a float32 accumulator; mixed input dtypes meet in the wider one (a float32 cotangent
    against bfloat16 weights stays float32); float32 products are full float32 (no TF32)."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    a, b = a.astype(dtype), b.astype(dtype)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _compiler_params(cfg: Config, kernel: int):
    """Triton compiler params of ``kernel`` (0 gmm, 1 tgmm) on GPU, None in interpret mode."""
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=cfg.blocks.num_warps[kernel], num_stages=cfg.blocks.num_stages[kernel])


def _rows_mask(r0, lo, hi, block: int, cols: int):
    rows = r0 + jnp.arange(block, dtype=jnp.int32)
    return jnp.broadcast_to(((rows >= lo) & (rows < hi))[:, None], (block, cols))


# ---------------------------------------------------------------------------------------------------
# gmm: out[r] = x[r] @ w[group(r)]   (forward and dX)
# ---------------------------------------------------------------------------------------------------


def _gmm_kernel(visit_ref, x_ref, w_ref, o_ref, *, transpose_rhs: bool, groups: int, bm: int, bk: int, bn: int):
    # visit_ref [4, V] | x_ref [M_pad, K] | w_ref [E, K, N] ([E, N, K] transposed) | o_ref [M_pad, N], all whole
    from jax.experimental.pallas import triton as pltriton

    v, j = pl.program_id(0), pl.program_id(1)
    g, tile, lo, hi = visit_ref[0, v], visit_ref[1, v], visit_ref[2, v], visit_ref[3, v]
    k_dim = x_ref.shape[1]
    r0 = pl.multiple_of(tile * bm, bm)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    rows = functools.partial(_rows_mask, r0, lo, hi, bm, bn)

    @pl.when((hi > lo) & (g < groups))
    def _():
        def body(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            a = x_ref[pl.ds(r0, bm), ks]  # rows of other groups too: computed, never stored
            if transpose_rhs:
                return acc + _dot(a, w_ref[g, cols, ks], trans_b=True)
            return acc + _dot(a, w_ref[g, ks, cols])

        acc = lax.fori_loop(0, k_dim // bk, body, jnp.zeros((bm, bn), jnp.float32))
        pltriton.store(o_ref.at[pl.ds(r0, bm), cols], acc.astype(o_ref.dtype), mask=rows())

    @pl.when((hi > lo) & (g == groups))  # the rows past sum(group_sizes)
    def _():
        pltriton.store(o_ref.at[pl.ds(r0, bm), cols], jnp.zeros((bm, bn), o_ref.dtype), mask=rows())


def gmm(x, w, visit, *, transpose_rhs: bool, out_dtype, cfg: Config, name: str = "grouped_matmul"):
    """x [M_pad, K] (M_pad a multiple of block_m), w [E, K, N] or [E, N, K], visit [4, V] -> [M_pad, N]."""
    m, k = x.shape
    e, n = w.shape[0], w.shape[1 if transpose_rhs else 2]
    bm = cfg.blocks.block_m  # fitted to M already (the visit list depends on it)
    bk, bn = _fit(cfg.blocks.block_k, k, "block_k", divide=True), _fit(cfg.blocks.block_n, n, "block_n", divide=True)
    kernel = functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs, groups=e, bm=bm, bk=bk, bn=bn)
    return pl.pallas_call(
        kernel,
        grid=(visit.shape[1], n // bn),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=_compiler_params(cfg, 0),
        interpret=cfg.interpret,
        name=name,
    )(visit, x, w)


# ---------------------------------------------------------------------------------------------------
# tgmm: out[e] = sum over group e's rows r of a[r]^T b[r]   (dW)
# ---------------------------------------------------------------------------------------------------


def _tgmm_kernel(bounds_ref, a_ref, b_ref, o_ref, *, bm: int, bp: int, bq: int):
    # bounds_ref [2, E + 1] | a_ref [M_pad, P], b_ref [M_pad, Q] whole | o_ref [bp, bq] (block (e, i, j))
    from jax.experimental.pallas import triton as pltriton

    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = bounds_ref[0, e], bounds_ref[1, e]
    ps = pl.ds(pl.multiple_of(i * bp, bp), bp)
    qs = pl.ds(pl.multiple_of(j * bq, bq), bq)

    def body(t, acc):
        r0 = pl.multiple_of(t * bm, bm)
        a = pltriton.load(a_ref.at[pl.ds(r0, bm), ps], mask=_rows_mask(r0, lo, hi, bm, bp), other=0)
        b = pltriton.load(b_ref.at[pl.ds(r0, bm), qs], mask=_rows_mask(r0, lo, hi, bm, bq), other=0)
        return acc + _dot(a, b, trans_a=True)

    # aligned row tiles that the group touches (none when it is empty); rows of neighbours are masked off
    first = lo // bm
    last = jnp.where(hi > lo, (hi + bm - 1) // bm, first)
    acc = lax.fori_loop(first, last, body, jnp.zeros((bp, bq), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def tgmm(a, b, bounds, *, out_dtype, cfg: Config):
    """a [M_pad, P], b [M_pad, Q], bounds [2, E + 1] -> [E, P, Q] float32-accumulated, zero for empty groups."""
    m, p = a.shape
    q = b.shape[1]
    e = bounds.shape[1] - 1
    blocks = cfg.blocks
    bm = min(blocks.tgmm_block_m, blocks.block_m)  # M_pad is a multiple of block_m, so of bm too
    bp = _fit(blocks.tgmm_block_p, p, "tgmm_block_p", divide=True)
    bq = _fit(blocks.tgmm_block_q, q, "tgmm_block_q", divide=True)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm, bp=bp, bq=bq),
        grid=(e, p // bp, q // bq),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.BlockSpec((None, bp, bq), lambda ei, i, j: (ei, i, j)),
        out_shape=jax.ShapeDtypeStruct((e, p, q), out_dtype),
        compiler_params=_compiler_params(cfg, 1),
        interpret=cfg.interpret,
        name="grouped_matmul_dw",
    )(bounds, a, b)


# ---------------------------------------------------------------------------------------------------
# custom_vjp
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, cfg: Config):
    return _grouped_fwd(x, w, group_sizes, cfg)[0]


def _grouped_fwd(x, w, group_sizes, cfg: Config):
    bounds = group_bounds(group_sizes, x.shape[0])
    visit = visits(bounds, x.shape[0], cfg.blocks.block_m)
    out = gmm(x, w, visit, transpose_rhs=cfg.transpose_rhs, out_dtype=jnp.dtype(cfg.out_dtype), cfg=cfg)
    return out, (x, w, group_sizes, bounds, visit)


def _grouped_bwd(cfg: Config, res, dy):
    x, w, group_sizes, bounds, visit = res
    dx = gmm(dy, w, visit, transpose_rhs=not cfg.transpose_rhs, out_dtype=x.dtype, cfg=cfg, name="grouped_matmul_dx")
    dw = tgmm(dy, x, bounds, out_dtype=w.dtype, cfg=cfg) if cfg.transpose_rhs else \
        tgmm(x, dy, bounds, out_dtype=w.dtype, cfg=cfg)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def resolve_impl(impl: str, platform: str) -> str:
    """``"pallas"`` or ``"ragged_dot"`` for ``impl`` on devices of ``platform``: ``auto`` is pallas on GPUs."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul impl={impl!r} is unknown: choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "pallas" if platform == "gpu" else "ragged_dot"
    return impl


def _check(x, w, group_sizes, transpose_rhs: bool):
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"expected x [M, K], w [E, K, N] and group_sizes [E]; got x {x.shape}, w {w.shape}, "
                         f"group_sizes {group_sizes.shape}")
    k_w = w.shape[2] if transpose_rhs else w.shape[1]
    if x.shape[1] != k_w or w.shape[0] != group_sizes.shape[0]:
        layout = "[E, N, K] (transpose_rhs=True)" if transpose_rhs else "[E, K, N]"
        raise ValueError(f"w must be {layout} with K = x.shape[1] = {x.shape[1]} and E = len(group_sizes) = "
                         f"{group_sizes.shape[0]}; got w {w.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers (int32); got {group_sizes.dtype}")


def grouped_matmul(x_MK, w_EKN, group_sizes_E, *, transpose_rhs: bool = False, impl: str = "auto",
                   block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                   preferred_element_type=None, platform: str | None = None) -> jax.Array:
    """Grouped matmul ``[M, K] x [E, K, N] -> [M, N]``: row r of group e is ``x[r] @ w[e]`` (module docstring).

    ``x_MK``'s rows are sorted by group: group e owns rows ``[sum(gs[:e]), sum(gs[:e+1]))``; rows past the total
    give 0, like ``jax.lax.ragged_dot``. ``transpose_rhs``: ``w`` is ``[E, N, K]`` and row r gives ``x[r] @ w[e].T``.
    Accumulates in float32; returns ``preferred_element_type``, else the promoted input dtype. Differentiable in
    ``x`` and ``w`` (``group_sizes`` gets none).
    ``impl``: ``"pallas"`` (the Triton kernels on GPU, Pallas interpret mode elsewhere), ``"ragged_dot"``
    (``jax.lax.ragged_dot``) or ``"auto"``: pallas on GPU devices, else ragged_dot.
    ``platform``: where the call runs (``"gpu"``, ``"cpu"``); None: the platform of ``x``'s devices, or of the default
    device when ``x`` is traced. Compile-only GPU devices on a CPU host, or a call inside ``shard_map``, should pass
    it. ``interpret``: None means interpret mode unless ``platform`` is ``"gpu"``.
    """
    _check(x_MK, w_EKN, group_sizes_E, transpose_rhs)
    if platform is None:
        tracer = isinstance(x_MK, jax.core.Tracer) or not isinstance(x_MK, jax.Array)
        platform = jax.devices()[0].platform if tracer else device_platform(x_MK)
    impl = resolve_impl(impl, platform)
    out_dtype = jnp.dtype(preferred_element_type or jnp.promote_types(x_MK.dtype, w_EKN.dtype))
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if impl == "ragged_dot":
        return ragged_dot(x_MK, w_EKN, group_sizes_E, transpose_rhs=transpose_rhs).astype(out_dtype)
    m, k = x_MK.shape
    n = w_EKN.shape[1 if transpose_rhs else 2]
    if m == 0:  # no rows: nothing to launch (and no gradient to give)
        return jnp.zeros((0, n), out_dtype)
    blocks = block_sizes or default_block_sizes(jnp.promote_types(x_MK.dtype, w_EKN.dtype))
    blocks = dataclasses.replace(blocks, block_m=_fit(blocks.block_m, m, "block_m", divide=False))
    # refuse untileable shapes and bad blocks now; each kernel fits K and N tiles to its own operands
    _fit(blocks.block_k, k, "block_k", divide=True), _fit(blocks.block_n, n, "block_n", divide=True)
    _fit(blocks.tgmm_block_m, m, "tgmm_block_m", divide=False)
    cfg = Config(transpose_rhs=bool(transpose_rhs), out_dtype=out_dtype.name, blocks=blocks,
                 interpret=platform != "gpu" if interpret is None else bool(interpret))
    m_pad = pl.cdiv(m, blocks.block_m) * blocks.block_m
    x_pad = x_MK if m_pad == m else jnp.pad(x_MK, ((0, m_pad - m), (0, 0)))
    out = _grouped(x_pad, w_EKN, group_sizes_E, cfg)
    return out if m_pad == m else out[:m]


def ragged_dot(x, w, group_sizes, *, transpose_rhs: bool = False):
    """``jax.lax.ragged_dot`` in float32 accumulation (``transpose_rhs``: contracting ``w``'s last dimension, no
    transposed copy); returns float32."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    precision = lax.Precision.HIGHEST if jnp.promote_types(x.dtype, w.dtype) == jnp.float32 else None
    return lax.ragged_dot_general(x, w, group_sizes, dims, precision=precision, preferred_element_type=jnp.float32)


def grouped_matmul_reference(x, w, group_sizes, *, transpose_rhs: bool = False, preferred_element_type=None):
    """Per-group masked einsum in float32 (materialises ``[E, M, N]``: tests only). Same contract as
    :func:`grouped_matmul`."""
    m = x.shape[0]
    bounds = group_bounds(jnp.asarray(group_sizes), m)[:, :-1]  # [2, E]
    rows = jnp.arange(m)
    member = (rows[None, :] >= bounds[0][:, None]) & (rows[None, :] < bounds[1][:, None])  # [E, M]
    spec = "mk,enk->emn" if transpose_rhs else "mk,ekn->emn"
    every = jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    out = jnp.sum(jnp.where(member[:, :, None], every, 0.0), axis=0)
    return out.astype(preferred_element_type or jnp.promote_types(x.dtype, w.dtype))
