"""FlashAttention-2 in Pallas: forward and backward, causal, packed documents, MHA/GQA/MQA.

Layout at the API is ``[B, S, H, D]`` (batch, sequence, heads, head_dim); the kernels read that layout
directly through BlockSpecs, so nothing is transposed. Shapes in comments: ``Bq`` / ``Bk`` are the query
and key block sizes, ``G = H // Hkv`` the number of query heads sharing one KV head.

Algorithm (Dao, "FlashAttention-2", 2023):
  forward   grid (S/Bq, B, H): one query block stays on chip while a ``fori_loop`` streams KV blocks
            through an online softmax in float32; writes ``O`` and the log-sum-exp ``L`` (base 2).
  backward  ``delta = rowsum(dO * O)`` in jnp, then two kernels that recompute ``P = exp2(S - L)``
            block by block: dK/dV (grid over KV blocks, loops over the G query heads of the KV head and
            over query blocks, so GQA sums happen in registers; it computes S^T and dP^T, keys first, so
            that every product can be a Hopper wgmma) and dQ (grid over query blocks, loops over KV
            blocks). No ``[S, S]`` array exists anywhere: memory is linear in S.
Causal: KV blocks entirely in a query block's future are skipped by the loop bounds
(:func:`kv_block_bound`, :func:`q_block_range`). Every visited block applies the elementwise mask (an
iota compare and a select); only blocks on the diagonal, at document edges or at the padded end
actually lose entries to it.
Attention sinks (``kernels/sinks.py``), only when given: the forward kernel reads each head's sink (base 2) and starts
its online softmax from it (running max = sink, denominator 1: a key whose value is zero), so ``O`` and ``L`` include
it; the backward kernels are unchanged (``L`` and ``delta`` from the corrected output are all they need), and the
sinks' own gradient is one jnp reduction (``sinks.sink_grad``). Without sinks no operand or instruction is added.

On GPU ``pallas_call`` lowers through Triton (deprecated in jax 0.11 in favour of Mosaic GPU, but still
working); the Triton compiler params must be passed explicitly, since jax >= 0.10 routes a
``pallas_call`` without them to Mosaic GPU. On CPU the same kernels run in Pallas interpret mode.
Tiles, warps and pipeline stages per head_dim and dtype (:func:`default_block_sizes`) are tuned so that
ptxas spills no register on H100 (``tests/test_gpu_compile_kernels.py``, ``experiments/kernel_ptxas.py``).
Pointer offsets: Pallas computes them in 64 bits once an operand exceeds 2^32 bytes (bfloat16: beyond
2^31 elements); below that int32 holds every offset, so per-device q/k/v past 2^31 elements are safe.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ulysses_jax.kernels.flash_blocks import (
    MIN_BLOCK,
    BlockSizes,
    check_shared_memory,
    default_block_sizes,
    fit_blocks,
    launch,
    next_pow2,
)
from ulysses_jax.kernels.sinks import check_sinks, sink_grad, vary_like
from ulysses_jax.kernels.window import check_window, kv_tiles, q_tiles

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp2(MASK - m) underflows to 0, never NaN
LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)); exp2 is the cheaper GPU instruction

@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff argument)."""

    causal: bool
    scale: float
    seq_len: int  # valid length; positions seq_len..S_padded-1 are padding
    padded_len: int
    group: int  # G = H // Hkv
    blocks: BlockSizes
    interpret: bool
    float32_out: bool = False  # O, dQ, dK, dV written in float32 (the ring's partial results), else the input dtype
    window: int | None = None  # causal sliding window (kernels/window.py); None: full
    offset: int = 0  # query row i sits at key position i + offset (a ring pair); 0: aligned

    def out_dtype(self, dtype):
        return jnp.float32 if self.float32_out else dtype

    @property
    def padded(self) -> bool:
        return self.padded_len != self.seq_len


# ---------------------------------------------------------------------------------------------------
# Pieces shared by all three kernels
# ---------------------------------------------------------------------------------------------------


def kv_block_bound(q_block, *, block_q: int, block_k: int, seq_len: int, causal: bool, window=None, offset=0):
    """One past the last KV block query block ``q_block`` must visit (it visits ``[kv_block_start, bound)``).

    Causal: the last key a query block can see is its own last row, so later KV blocks are skipped.
    KV blocks made only of padding (at or past ``seq_len``) are skipped too (``window.kv_tiles``).
    """
    return kv_tiles(q_block, block_q=block_q, block_k=block_k, seq_len=seq_len, causal=causal, window=window,
                    offset=offset)[1]


def kv_block_start(q_block, *, block_q: int, block_k: int, seq_len: int, causal: bool, window=None, offset=0):
    """The first KV block query block ``q_block`` visits: 0, or with a window the first inside its first row's."""
    return kv_tiles(q_block, block_q=block_q, block_k=block_k, seq_len=seq_len, causal=causal, window=window,
                    offset=offset)[0]


def q_block_range(kv_block, *, block_q: int, block_k: int, seq_len: int, causal: bool, window=None, offset=0):
    """Query blocks ``[lo, hi)`` that can see KV block ``kv_block``; the dK/dV kernel visits only those.

    Causal: query blocks entirely before the KV block are skipped; with a window, those entirely past its last
    key's window. Query blocks made only of padding are skipped (their dO is 0), and a KV block made only of
    padding is seen by no query block. int32 throughout (``window.q_tiles``).
    """
    return q_tiles(kv_block, block_q=block_q, block_k=block_k, seq_len=seq_len, causal=causal, window=window,
                   offset=offset)


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with a float32 accumulator; the transposes are folded into the contraction."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    # float32 inputs: full float32 products (Triton would otherwise use TF32 for DEFAULT precision)
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 and b.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(q_start, k_start, q_seg, k_seg, *, block_q: int, block_k: int, cfg: Config):
    """Boolean ``[Bq, Bk]`` of allowed (query, key) pairs, or None when nothing needs masking."""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    q_pos = q_start + cfg.offset + jnp.arange(block_q)
    k_pos = k_start + jnp.arange(block_k)
    if cfg.causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if cfg.window is not None:
        mask = both(mask, (q_pos[:, None] - k_pos[None, :]) < cfg.window)
    if cfg.padded:
        mask = both(mask, jnp.broadcast_to((k_pos < cfg.seq_len)[None, :], (block_q, block_k)))
    if q_seg is not None:
        mask = both(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _logits(q, k, q_start, k_start, q_seg, k_seg, *, block_q, block_k, cfg, keys_first: bool = False):
    """Masked base-2 logits ``[Bq, Bk]`` in float32: ``scale * log2(e) * q @ k.T``; ``keys_first``: their
    transpose ``[Bk, Bq]``, computed as ``k @ q.T`` (the dK/dV kernel's layout, see :func:`_dkv_kernel`)."""
    s = (_dot(k, q, trans_b=True) if keys_first else _dot(q, k, trans_b=True)) * (cfg.scale * LOG2_E)
    mask = _mask(q_start, k_start, q_seg, k_seg, block_q=block_q, block_k=block_k, cfg=cfg)
    if mask is not None and keys_first:
        mask = mask.T
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def _compiler_params(cfg: Config, kernel: int, head_dim: int):
    """Triton compiler params of ``kernel`` (0 forward, 1 dK/dV, 2 dQ) on GPU, None in interpret mode.
    Always passed on GPU: without them jax >= 0.10 lowers a pallas_call to Mosaic GPU
    (``jax_pallas_use_mosaic_gpu`` defaults to True). The class is
    ``jax.experimental.pallas.triton.CompilerParams`` (jax 0.10.2, 0.11 docs); older jax called it
    ``pl.TritonCompilerParams``."""
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    num_warps, num_stages = launch(cfg.blocks, kernel, head_dim)
    params_cls = getattr(pltriton, "CompilerParams", None) or getattr(pl, "TritonCompilerParams")
    return params_cls(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, sink_ref, o_ref, lse_ref, *, cfg: Config):
    # q_ref [Bq, D] | k_ref, v_ref [S, D] (this head's KV head) | q_seg_ref, k_seg_ref [S] or None
    # sink_ref [Bq] (this head's sink in base 2, repeated) or None | o_ref [Bq, D] | lse_ref [Bq]
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    qi = pl.program_id(0)
    q = q_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[pl.ds(qi * bq, bq)]

    def body(kj, carry):
        acc, m, l = carry  # [Bq, D], [Bq], [Bq]: running numerator, max, denominator
        ks = pl.ds(kj * bk, bk)
        k_seg = None if k_seg_ref is None else k_seg_ref[ks]
        s = _logits(q, k_ref[ks, :], qi * bq, kj * bk, q_seg, k_seg, block_q=bq, block_k=bk, cfg=cfg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp2(s - m_new[:, None])
        v = v_ref[ks, :]
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((bq, q.shape[-1]), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    if sink_ref is not None:  # the sink: one more logit whose value vector is zero (a -inf sink: none)
        sink = sink_ref[...]
        init = (init[0], sink, jnp.where(sink == -jnp.inf, 0.0, 1.0))
    bounds = dict(block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal, window=cfg.window,
                  offset=cfg.offset)
    acc, m, l = lax.fori_loop(kv_block_start(qi, **bounds), kv_block_bound(qi, **bounds), body, init)
    # A row whose max never rose above MASK_VALUE saw no key at all (only padded rows with segment ids
    # can): give it O = 0 and L = +inf, so the backward's exp2(s - L) is exactly 0 for it. Written as
    # `m <= MASK` rather than `not m > MASK` so that NaN inputs still propagate NaN.
    empty = m <= MASK_VALUE
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l))


def forward(q, k, v, seg, cfg: Config, sinks=None):
    """q [B, S, H, D], k/v [B, S, Hkv, D], seg (query ids, key ids) [B, S] each | None, sinks [H] | None
    -> (O [B, S, H, D], L [B, H, S] float32, base 2; with sinks, theirs in both)."""
    b, s, h, d = q.shape
    bq, g = cfg.blocks.block_q, cfg.group
    whole_kv = pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0))
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
    sink_spec = None if sinks is None else pl.BlockSpec((None, bq), lambda i, bi, hi: (hi, 0))
    if sinks is not None:  # [H, Bq]: each head's sink in base 2, repeated over a query block's rows
        sinks = jnp.broadcast_to((sinks.astype(jnp.float32) * LOG2_E)[:, None], (h, bq))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(s // bq, b, h),
        in_specs=[q_block, whole_kv, whole_kv, seg_spec, seg_spec, sink_spec],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, cfg.out_dtype(q.dtype)), jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        compiler_params=_compiler_params(cfg, 0, d),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *_segments(seg), sinks)


# ---------------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------------


def _segments(seg) -> tuple:
    """``(query ids, key ids)`` for the kernels' two segment-id operands (``(None, None)`` without ids)."""
    return (None, None) if seg is None else seg


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, scale=None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None, window: int | None = None,
                    sinks=None):
    """Memory-efficient exact attention.

    q: [B, S, H, D]; k, v: [B, S, Hkv, D] with H % Hkv == 0 (MHA, GQA, MQA; KV heads are never
    repeated in memory). segment_ids: [B, S] integers or None: a token attends only to tokens with
    the same id (packed documents), and when ``causal`` not to later positions. scale defaults to
    1/sqrt(D) (a Python float). ``interpret=None`` means Pallas interpret mode unless the default device
    is a GPU; callers that know the target pass it (``attention`` does: compile-only GPU devices need
    ``False``). Any S works (padded to a block multiple inside, padded keys masked); any D (zero-padded
    to a power of two >= 16). Returns [B, S, H, D] in q.dtype. On GPU, tiles that need more shared
    memory than a block has (:func:`shared_memory_bytes`) raise ValueError before anything compiles. ``sinks``:
    ``[H]`` attention-sink logits (``kernels/sinks.py``), differentiable, or None.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q [B,S,H,D] and k, v [B,S,Hkv,D]; got {q.shape=}, {k.shape=}, {v.shape=}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"k/v batch, sequence and head_dim must match q: {q.shape=}, {k.shape=}")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be divisible by kv heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must have shape {(b, s)}; got {segment_ids.shape}")
    sinks = None if check_sinks(sinks, h) is None else vary_like(sinks, q)
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    blocks = fit_blocks(block_sizes or default_block_sizes(d, q.dtype), s)
    multiple = max(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("block_"))
    s_pad = pl.cdiv(s, multiple) * multiple
    d_pad = max(MIN_BLOCK, next_pow2(d))
    if not interpret:
        check_shared_memory(blocks, d, q.dtype, segment_ids is not None)
    cfg = Config(causal=bool(causal), scale=float(1.0 / math.sqrt(d) if scale is None else scale),
                  seq_len=s, padded_len=s_pad, group=h // k.shape[2], blocks=blocks, interpret=bool(interpret),
                  window=check_window(window, causal=causal))

    def pad(x):  # [B, S, heads, D] -> [B, S_pad, heads, D_pad] with zeros; padded keys are masked by length
        return x if (s_pad, d_pad) == (s, d) else jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d)))

    seg = segment_ids
    if seg is not None:  # [B, S] -> [B, S_pad]; -1 for padding (the length mask hides it anyway)
        seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, s_pad - s)), constant_values=-1)
        seg = (seg, seg)  # queries and keys of one sequence: the same ids
    out = _flash(pad(q), pad(k), pad(v), seg, sinks, cfg)
    return out[:, :s, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, seg, sinks, cfg: Config):
    return forward(q, k, v, seg, cfg, sinks)[0]


def _flash_fwd(q, k, v, seg, sinks, cfg: Config):
    out, lse = forward(q, k, v, seg, cfg, sinks)
    return out, (q, k, v, seg, sinks, out, lse)


def _flash_bwd(cfg: Config, res, do):
    q, k, v, seg, sinks, out, lse = res
    # delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij: [B, S, H] -> [B, H, S], float32
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    dq = backward_dq(q, k, v, seg, do, lse, delta, cfg)
    # dK, dV go into K's and V's buffers (backward_dkv) after the dQ kernel, which reads K and V whole (the barrier)
    k, v, _ = lax.optimization_barrier((k, v, dq))
    dk, dv = backward_dkv(q, k, v, seg, do, lse, delta, cfg)
    dsinks = None if sinks is None else sink_grad(sinks, lse * math.log(2.0), delta)  # L is base 2
    return dq, dk, dv, None if seg is None else (None, None), dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                cfg: Config):
    # q_ref, do_ref [S, G, D] (the G query heads of this KV head) | k_ref, v_ref [Bk, D]
    # lse_ref, delta_ref [G, S] | q_seg_ref, k_seg_ref [S] or None | dk_ref, dv_ref [Bk, D]
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    kj = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(kj * bk, bk)]

    def q_step(qi, carry, g):
        # Keys first: every product here has the KV block (Bk rows) as its M dimension, the one a Hopper
        # warpgroup MMA (wgmma) needs to be a multiple of 64; with queries first, S = Q K^T and dP = dO V^T
        # would have only Bq rows and Triton would fall back to Ampere-style mma.sync for them.
        dk, dv = carry
        qs = pl.ds(qi * bq, bq)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        q_seg = None if q_seg_ref is None else q_seg_ref[qs]
        s_t = _logits(q, k, qi * bq, kj * bk, q_seg, k_seg, block_q=bq, block_k=bk, cfg=cfg, keys_first=True)
        p_t = jnp.exp2(s_t - lse_ref[g, qs][None, :])  # [Bk, Bq] probabilities (transposed), recomputed
        dv = dv + _dot(p_t.astype(do.dtype), do)
        dp_t = _dot(v, do, trans_b=True)  # [Bk, Bq]
        ds_t = p_t * (dp_t - delta_ref[g, qs][None, :])  # d(loss)/d(logits)^T, before the softmax scale
        dk = dk + _dot(ds_t.astype(q.dtype), q)
        return dk, dv

    lo, hi = q_block_range(kj, block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal, window=cfg.window,
                           offset=cfg.offset)

    def head_step(g, carry):  # GQA: this KV head's gradient sums over its G query heads
        return lax.fori_loop(lo, hi, functools.partial(q_step, g=g), carry)

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(0, cfg.group, head_step, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_dkv(q, k, v, seg, do, lse, delta, cfg: Config):
    """``(dK, dV)``, in place of ``K`` and ``V`` where their dtypes agree: program ``j`` reads K's and V's block ``j``
    before it writes their gradients there, and no other program reads that block (XLA copies K and V first where
    the caller still reads them afterwards)."""
    b, s, hkv, d = k.shape
    bk, g = cfg.blocks.block_k_dkv, cfg.group
    q_heads = pl.BlockSpec((None, s, g, d), lambda j, bi, hi: (bi, 0, hi, 0))
    kv_block = pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi, 0))
    rows = pl.BlockSpec((None, g, s), lambda j, bi, hi: (bi, hi, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, s), lambda j, bi, hi: (bi, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        grid=(s // bk, b, hkv),
        in_specs=[q_heads, kv_block, kv_block, seg_spec, seg_spec, q_heads, rows, rows],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, cfg.out_dtype(k.dtype)),
                   jax.ShapeDtypeStruct(v.shape, cfg.out_dtype(v.dtype))],
        input_output_aliases={1: 0, 2: 1} if cfg.out_dtype(k.dtype) == k.dtype == v.dtype else {},
        compiler_params=_compiler_params(cfg, 1, d),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, *_segments(seg), do, lse, delta)


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: Config):
    # q_ref, do_ref, dq_ref [Bq, D] | k_ref, v_ref [S, D] | lse_ref, delta_ref [Bq] | q_seg_ref, k_seg_ref [S] or None
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    qi = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[pl.ds(qi * bq, bq)]

    def body(kj, dq):
        ks = pl.ds(kj * bk, bk)
        k_seg = None if k_seg_ref is None else k_seg_ref[ks]
        k = k_ref[ks, :]
        s = _logits(q, k, qi * bq, kj * bk, q_seg, k_seg, block_q=bq, block_k=bk, cfg=cfg)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (_dot(do, v_ref[ks, :], trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    bounds = dict(block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal, window=cfg.window,
                  offset=cfg.offset)
    dq = lax.fori_loop(kv_block_start(qi, **bounds), kv_block_bound(qi, **bounds), body,
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def backward_dq(q, k, v, seg, do, lse, delta, cfg: Config):
    b, s, h, d = q.shape
    bq, g = cfg.blocks.block_q_dq, cfg.group
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    whole_kv = pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0))
    rows = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))
    seg_spec = None if seg is None else pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(s // bq, b, h),
        in_specs=[q_block, whole_kv, whole_kv, seg_spec, seg_spec, q_block, rows, rows],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, cfg.out_dtype(q.dtype)),
        compiler_params=_compiler_params(cfg, 2, d),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, *_segments(seg), do, lse, delta)


# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def reference(q, k, v, *, causal=True, segment_ids=None, scale=None):
    """Plain jnp attention with a float32 softmax; materialises [B, H, S, S]. Same contract as
    :func:`flash_attention` (rows that see no key return 0)."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((b, 1, s, s), dtype=bool)
    if causal:
        mask &= jnp.tril(jnp.ones((s, s), dtype=bool))
    if segment_ids is not None:
        mask &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    probs = jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1)
    probs = jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32)).astype(q.dtype)
