"""FlashAttention-2 in Pallas: forward and backward, causal, packed documents, MHA/GQA/MQA.

Layout at the API is ``[B, S, H, D]`` (batch, sequence, heads, head_dim); the kernels read that layout
directly through BlockSpecs, so nothing is transposed. Shapes in comments: ``Bq`` / ``Bk`` are the query
and key block sizes, ``G = H // Hkv`` the number of query heads sharing one KV head.

Algorithm (Dao, "FlashAttention-2", 2023):
  forward   grid (S/Bq, B, H): one query block stays on chip while a ``fori_loop`` streams KV blocks
            through an online softmax in float32; writes ``O`` and the log-sum-exp ``L`` (base 2).
  backward  ``delta = rowsum(dO * O)`` in jnp, then two kernels that recompute ``P = exp2(S - L)``
            block by block: dK/dV (grid over KV blocks, loops over the G query heads of the KV head and
            over query blocks, so GQA sums happen in registers) and dQ (grid over query blocks, loops
            over KV blocks). No ``[S, S]`` array exists anywhere: memory is linear in S.
Causal: KV blocks entirely in a query block's future are skipped by the loop bounds
(:func:`kv_block_bound`, :func:`q_block_range`). Every visited block applies the elementwise mask (an
iota compare and a select); only blocks on the diagonal, at document edges or at the padded end
actually lose entries to it.

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

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp2(MASK - m) underflows to 0, never NaN
LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)); exp2 is the cheaper GPU instruction
MIN_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16
SHARED_MEMORY_PER_BLOCK = 232_448  # bytes, the opt-in limit per thread block of H100 and H200 (sm_90)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16) and GPU launch settings. Larger than the sequence? They shrink.

    As in Triton's fused-attention tutorial, the dK/dV kernel keeps a tall KV block and streams thin
    query blocks, the dQ kernel the reverse. ``num_warps`` / ``num_stages`` apply to the GPU (Triton)
    lowering only: one value for all three kernels, a tuple ``(forward, dK/dV, dQ)``, or ``None`` for a
    heuristic. ``flash_attention(block_sizes=None)`` uses :func:`default_block_sizes`, tuned per head_dim
    and dtype; the class defaults below are the untuned starting point.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_dkv: int = 32
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 32
    num_warps: int | tuple[int, int, int] | None = None
    num_stages: int | tuple[int, int, int] | None = None


# Tuned on the H100 target (sm_90a, ptxas via XLA's deviceless compile; see experiments/kernel_ptxas.py): per
# (head_dim rounded up to a power of two, bytes per element) the six block sizes and per-kernel warps and
# stages (forward, dK/dV, dQ). Chosen as the largest tiles with no register spill at any sequence length,
# with and without segment ids, causal or not, MHA or GQA, and within the shared memory per block.
_TUNED: dict[tuple[int, int], BlockSizes] = {
    (64, 2): BlockSizes(128, 128, 32, 128, 128, 64, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
    (128, 2): BlockSizes(128, 64, 32, 64, 128, 32, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
    (256, 2): BlockSizes(64, 64, 16, 64, 64, 32, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
    (64, 4): BlockSizes(64, 32, 32, 64, 64, 32, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
    (128, 4): BlockSizes(32, 32, 32, 32, 32, 32, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
    (256, 4): BlockSizes(32, 32, 16, 32, 32, 16, num_warps=(8, 8, 8), num_stages=(2, 1, 2)),
}


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The tuned :class:`BlockSizes` for ``head_dim`` and ``dtype`` (``flash_attention``'s default).

    Head dims round up to the next tuned size (64, 128, 256); larger ones get the 256 entry, which
    :func:`flash_attention` then refuses on GPU if its tiles exceed the shared memory per block.
    """
    itemsize = 2 if jnp.dtype(dtype).itemsize <= 2 else 4
    dims = sorted(d for d, i in _TUNED if i == itemsize)
    d = next((d for d in dims if d >= head_dim), dims[-1])
    return _TUNED[d, itemsize]


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff argument)."""

    causal: bool
    scale: float
    seq_len: int  # valid length; positions seq_len..S_padded-1 are padding
    padded_len: int
    group: int  # G = H // Hkv
    blocks: BlockSizes
    interpret: bool
    float32_out: bool = False  # O, dQ, dK, dV written in float32 (the ring's partial results), else the input dtype

    def out_dtype(self, dtype):
        return jnp.float32 if self.float32_out else dtype

    @property
    def padded(self) -> bool:
        return self.padded_len != self.seq_len


# ---------------------------------------------------------------------------------------------------
# Pieces shared by all three kernels
# ---------------------------------------------------------------------------------------------------


def kv_block_bound(q_block, *, block_q: int, block_k: int, seq_len: int, causal: bool):
    """Number of KV blocks query block ``q_block`` must visit: it visits ``[0, bound)``.

    Causal: the last key a query block can see is its own last row, so later KV blocks are skipped.
    KV blocks made only of padding (at or past ``seq_len``) are skipped too.
    """
    num_kv_blocks = pl.cdiv(seq_len, block_k)
    if not causal:
        return num_kv_blocks
    return jnp.minimum(lax.div((q_block + 1) * block_q + block_k - 1, block_k), num_kv_blocks)


def q_block_range(kv_block, *, block_q: int, block_k: int, seq_len: int, causal: bool):
    """Query blocks ``[lo, hi)`` that can see KV block ``kv_block``; the dK/dV kernel visits only those.

    Causal: query blocks entirely before the KV block are skipped. Query blocks made only of padding
    are skipped (their dO is 0), and a KV block made only of padding is seen by no query block.
    """
    # int32 throughout: a where() of two Python ints lowers to an i1 loop bound on Triton (non-causal)
    lo = lax.div(kv_block * block_k, block_q) if causal else jnp.int32(0)
    hi = jnp.where(kv_block * block_k < seq_len, jnp.int32(pl.cdiv(seq_len, block_q)), lo)
    return lo, hi


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with a float32 accumulator; the transposes are folded into the contraction."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    # float32 inputs: full float32 products (Triton would otherwise use TF32 for DEFAULT precision)
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 and b.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(q_start, k_start, q_seg, k_seg, *, block_q: int, block_k: int, cfg: _Config):
    """Boolean ``[Bq, Bk]`` of allowed (query, key) pairs, or None when nothing needs masking."""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    q_pos = q_start + jnp.arange(block_q)
    k_pos = k_start + jnp.arange(block_k)
    if cfg.causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if cfg.padded:
        mask = both(mask, jnp.broadcast_to((k_pos < cfg.seq_len)[None, :], (block_q, block_k)))
    if q_seg is not None:
        mask = both(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _logits(q, k, q_start, k_start, q_seg, k_seg, *, block_q, block_k, cfg):
    """Masked base-2 logits ``[Bq, Bk]`` in float32: ``scale * log2(e) * q @ k.T``."""
    s = _dot(q, k, trans_b=True) * (cfg.scale * LOG2_E)
    mask = _mask(q_start, k_start, q_seg, k_seg, block_q=block_q, block_k=block_k, cfg=cfg)
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


KERNELS = ("fwd", "dkv", "dq")  # kernel i is named flash_attention_{KERNELS[i]} on the GPU


def _tiles(blocks: BlockSizes, kernel: int) -> tuple[int, int]:
    """(query block, key block) of kernel 0 forward, 1 dK/dV, 2 dQ."""
    return ((blocks.block_q, blocks.block_k), (blocks.block_q_dkv, blocks.block_k_dkv),
            (blocks.block_q_dq, blocks.block_k_dq))[kernel]


def _launch(blocks: BlockSizes, kernel: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) of ``kernel``: the value in ``blocks``, else 8 warps (4 for tiles of
    32 x 32 or less at head_dim <= 64) and 2 stages."""
    bq, bk = _tiles(blocks, kernel)

    def pick(value, fallback):
        value = value[kernel] if isinstance(value, tuple) else value
        return fallback if value is None else value

    return (pick(blocks.num_warps, 4 if bq * bk <= 32 * 32 and head_dim <= 64 else 8),
            pick(blocks.num_stages, 2))


def shared_memory_bytes(blocks: BlockSizes, head_dim: int, dtype, *, segment_ids: bool = False) -> dict[str, int]:
    """Estimated dynamic shared memory per block of each GPU kernel, ``{"fwd": bytes, "dkv": ..., "dq": ...}``.

    Triton keeps one buffer per pipeline stage for each tile a loop streams (K and V in the forward and
    dQ kernels, Q and dO in dK/dV) plus the tiles loaded once. Checked against the compiled H100 kernels
    (experiments/kernel_ptxas.py): exact for bfloat16 forward and dQ kernels with >= 2 stages and query
    blocks >= 64, an upper bound otherwise (by at most about 1.7x in the sweeps).
    """
    e, d = jnp.dtype(dtype).itemsize, max(MIN_BLOCK, _next_pow2(head_dim))
    seg = 4 if segment_ids else 0  # int32 ids of the streamed positions
    out = {}
    for i, name in enumerate(KERNELS):
        bq, bk = _tiles(blocks, i)
        stages = _launch(blocks, i, d)[1]
        if name == "fwd":  # Q once; K, V per stage (one stage: one K and one V tile); float32 P re-laid out
            out[name] = (e * d * (bq + 2 * bk * (stages if stages > 1 else 1)) + seg * bk * stages
                         + (4 * bq * (bk + 4) if e == 4 else 0))
        elif name == "dkv":  # K, V once; Q, dO, L, delta per stage; P^T and dS^T for the transposed products
            s = max(stages, 2)
            out[name] = e * d * (2 * bk + 2 * bq * s) + 2 * e * bq * bk + (8 + seg) * bq * s
        else:  # Q, dO once; K, V per stage
            out[name] = e * d * (2 * bq + 2 * bk * stages) + seg * bk * stages
    return out


def _compiler_params(cfg: _Config, kernel: int, head_dim: int):
    """Triton compiler params of ``kernel`` (0 forward, 1 dK/dV, 2 dQ) on GPU, None in interpret mode.
    Always passed on GPU: without them jax >= 0.10 lowers a pallas_call to Mosaic GPU
    (``jax_pallas_use_mosaic_gpu`` defaults to True). The class is
    ``jax.experimental.pallas.triton.CompilerParams`` (jax 0.10.2, 0.11 docs); older jax called it
    ``pl.TritonCompilerParams``."""
    if cfg.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    num_warps, num_stages = _launch(cfg.blocks, kernel, head_dim)
    params_cls = getattr(pltriton, "CompilerParams", None) or getattr(pl, "TritonCompilerParams")
    return params_cls(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, *, cfg: _Config):
    # q_ref [Bq, D] | k_ref, v_ref [S, D] (this head's KV head) | q_seg_ref, k_seg_ref [S] or None
    # o_ref [Bq, D] | lse_ref [Bq]
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
    hi = kv_block_bound(qi, block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal)
    acc, m, l = lax.fori_loop(0, hi, body, init)
    # A row whose max never rose above MASK_VALUE saw no key at all (only padded rows with segment ids
    # can): give it O = 0 and L = +inf, so the backward's exp2(s - L) is exactly 0 for it. Written as
    # `m <= MASK` rather than `not m > MASK` so that NaN inputs still propagate NaN.
    empty = m <= MASK_VALUE
    l = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l))


def _forward(q, k, v, seg, cfg: _Config):
    """q [B, S, H, D], k/v [B, S, Hkv, D], seg (query ids, key ids) [B, S] each | None
    -> (O [B, S, H, D], L [B, H, S] float32)."""
    b, s, h, d = q.shape
    bq, g = cfg.blocks.block_q, cfg.group
    whole_kv = pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, lax.div(hi, g), 0))
    q_block = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(s // bq, b, h),
        in_specs=[q_block, whole_kv, whole_kv, seg_spec, seg_spec],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, cfg.out_dtype(q.dtype)), jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        compiler_params=_compiler_params(cfg, 0, d),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *_segments(seg))


# ---------------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------------


def _segments(seg) -> tuple:
    """``(query ids, key ids)`` for the kernels' two segment-id operands (``(None, None)`` without ids)."""
    return (None, None) if seg is None else seg


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit_blocks(blocks: BlockSizes, seq_len: int) -> BlockSizes:
    """Validate block sizes and shrink those larger than the (power-of-two rounded) sequence."""
    cap = max(MIN_BLOCK, _next_pow2(seq_len))
    sizes = {}
    for f in dataclasses.fields(blocks):
        if f.name.startswith("block_"):
            size = getattr(blocks, f.name)
            if size < MIN_BLOCK or size & (size - 1):
                raise ValueError(f"{f.name}={size} must be a power of two >= {MIN_BLOCK}")
            sizes[f.name] = min(size, cap)
    return dataclasses.replace(blocks, **sizes)


def _check_shared_memory(blocks: BlockSizes, head_dim: int, dtype, segment_ids: bool) -> None:
    """Refuse, before anything compiles, tiles whose shared memory exceeds the GPU's limit per block."""
    for name, need in shared_memory_bytes(blocks, head_dim, dtype, segment_ids=segment_ids).items():
        if need > SHARED_MEMORY_PER_BLOCK:
            raise ValueError(
                f"flash_attention_{name} at head_dim {head_dim} in {jnp.dtype(dtype).name} needs about {need:,} "
                f"bytes of shared memory per block with {blocks}, over the GPU's {SHARED_MEMORY_PER_BLOCK:,}: "
                f"pass smaller BlockSizes (block sizes or num_stages), or bfloat16 inputs")


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, scale=None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Memory-efficient exact attention.

    q: [B, S, H, D]; k, v: [B, S, Hkv, D] with H % Hkv == 0 (MHA, GQA, MQA; KV heads are never
    repeated in memory). segment_ids: [B, S] integers or None: a token attends only to tokens with
    the same id (packed documents), and when ``causal`` not to later positions. scale defaults to
    1/sqrt(D) (a Python float). ``interpret=None`` means Pallas interpret mode unless the default device
    is a GPU; callers that know the target pass it (``attention`` does: compile-only GPU devices need
    ``False``). Any S works (padded to a block multiple inside, padded keys masked); any D (zero-padded
    to a power of two >= 16). Returns [B, S, H, D] in q.dtype. On GPU, tiles that need more shared
    memory than a block has (:func:`shared_memory_bytes`) raise ValueError before anything compiles.
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
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    blocks = _fit_blocks(block_sizes or default_block_sizes(d, q.dtype), s)
    multiple = max(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("block_"))
    s_pad = pl.cdiv(s, multiple) * multiple
    d_pad = max(MIN_BLOCK, _next_pow2(d))
    if not interpret:
        _check_shared_memory(blocks, d, q.dtype, segment_ids is not None)
    cfg = _Config(causal=bool(causal), scale=float(1.0 / math.sqrt(d) if scale is None else scale),
                  seq_len=s, padded_len=s_pad, group=h // k.shape[2], blocks=blocks, interpret=bool(interpret))

    def pad(x):  # [B, S, heads, D] -> [B, S_pad, heads, D_pad] with zeros; padded keys are masked by length
        return x if (s_pad, d_pad) == (s, d) else jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d)))

    seg = segment_ids
    if seg is not None:  # [B, S] -> [B, S_pad]; -1 for padding (the length mask hides it anyway)
        seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, s_pad - s)), constant_values=-1)
        seg = (seg, seg)  # queries and keys of one sequence: the same ids
    out = _flash(pad(q), pad(k), pad(v), seg, cfg)
    return out[:, :s, :, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, cfg: _Config):
    return _forward(q, k, v, seg, cfg)[0]


def _flash_fwd(q, k, v, seg, cfg: _Config):
    out, lse = _forward(q, k, v, seg, cfg)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(cfg: _Config, res, do):
    q, k, v, seg, out, lse = res
    # delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij: [B, S, H] -> [B, H, S], float32
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    dk, dv = _backward_dkv(q, k, v, seg, do, lse, delta, cfg)
    dq = _backward_dq(q, k, v, seg, do, lse, delta, cfg)
    return dq, dk, dv, None if seg is None else (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                cfg: _Config):
    # q_ref, do_ref [S, G, D] (the G query heads of this KV head) | k_ref, v_ref [Bk, D]
    # lse_ref, delta_ref [G, S] | q_seg_ref, k_seg_ref [S] or None | dk_ref, dv_ref [Bk, D]
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    kj = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(kj * bk, bk)]

    def q_step(qi, carry, g):
        dk, dv = carry
        qs = pl.ds(qi * bq, bq)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        q_seg = None if q_seg_ref is None else q_seg_ref[qs]
        s = _logits(q, k, qi * bq, kj * bk, q_seg, k_seg, block_q=bq, block_k=bk, cfg=cfg)
        p = jnp.exp2(s - lse_ref[g, qs][:, None])  # [Bq, Bk] probabilities, recomputed
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta_ref[g, qs][:, None])  # d(loss)/d(logits), before the softmax scale
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    lo, hi = q_block_range(kj, block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal)

    def head_step(g, carry):  # GQA: this KV head's gradient sums over its G query heads
        return lax.fori_loop(lo, hi, functools.partial(q_step, g=g), carry)

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(0, cfg.group, head_step, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkv(q, k, v, seg, do, lse, delta, cfg: _Config):
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
        compiler_params=_compiler_params(cfg, 1, d),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, *_segments(seg), do, lse, delta)


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Config):
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

    hi = kv_block_bound(qi, block_q=bq, block_k=bk, seq_len=cfg.seq_len, causal=cfg.causal)
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, seg, do, lse, delta, cfg: _Config):
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
# Ring steps: one (query block, KV block) pair, with the log-sum-exp (ring.LocalKernel)
# ---------------------------------------------------------------------------------------------------


def _pair_config(q, k, *, causal: bool, scale: float, interpret: bool | None, segment_ids: bool,
                 float32: bool = True) -> _Config:
    """The kernels' config for a ring pair: equal query and KV lengths, float32 outputs unless ``float32=False``."""
    b, s, h, d = q.shape
    if k.shape[1] != s:
        raise ValueError(f"a ring pair needs equal query and KV block lengths; got {q.shape=}, {k.shape=}")
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    blocks = _fit_blocks(default_block_sizes(d, q.dtype), s)
    multiple = max(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("block_"))
    if not interpret:
        _check_shared_memory(blocks, d, q.dtype, segment_ids)
    return _Config(causal=bool(causal), scale=float(scale), seq_len=s, padded_len=pl.cdiv(s, multiple) * multiple,
                   group=h // k.shape[2], blocks=blocks, interpret=bool(interpret), float32_out=bool(float32))


def _pair_pad(cfg: _Config, head_dim: int):
    """Pads ``[B, S, heads, D]`` to ``[B, S_pad, heads, D_pad]`` and ``[B, S]`` segment ids to ``[B, S_pad]``."""
    s, s_pad, d_pad = cfg.seq_len, cfg.padded_len, max(MIN_BLOCK, _next_pow2(head_dim))

    def pad(x):
        return x if (s_pad, d_pad) == (s, head_dim) else jnp.pad(
            x, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - head_dim)))

    def pad_ids(x):  # -1 on padded rows; padded keys are masked by the length anyway
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, s_pad - s)), constant_values=-1)

    return pad, pad_ids


def pair_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool, scale: float, interpret: bool | None = None,
                 float32: bool = True):
    """One ring pair: ``o [b, s, H, D]`` float32 (``float32=False``: in q's dtype), normalised (0 for a row that sees
    no key), and ``lse [b, H, s]`` float32 in natural log (``-inf`` there). ``causal`` is the aligned mask: query and
    key positions coincide (``ring.py`` asks for it only then), so the positions themselves are not read."""
    del q_pos, k_pos
    b, s, h, d = q.shape
    cfg = _pair_config(q, k, causal=causal, scale=scale, interpret=interpret, segment_ids=q_seg is not None,
                       float32=float32)
    pad, pad_ids = _pair_pad(cfg, d)
    seg = None if q_seg is None else (pad_ids(q_seg), pad_ids(k_seg))
    o, lse2 = _forward(pad(q), pad(k), pad(v), seg, cfg)
    lse = jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * math.log(2.0))  # base 2 -> natural; empty rows -> -inf
    return o[:, :s, :, :d], lse[:, :, :s]


def pair_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, do, lse, delta, *, causal: bool, scale: float,
                  interpret: bool | None = None, float32: bool = True):
    """Gradients of one ring pair given the *global* ``lse`` (natural log, ``-inf`` for a row that sees no key
    anywhere) and ``delta = rowsum(dO * O)``, both ``[b, H, s]`` float32: float32 ``dq``, ``dk``, ``dv``
    (``float32=False``: in the inputs' dtypes)."""
    del q_pos, k_pos
    b, s, h, d = q.shape
    cfg = _pair_config(q, k, causal=causal, scale=scale, interpret=interpret, segment_ids=q_seg is not None,
                       float32=float32)
    pad, pad_ids = _pair_pad(cfg, d)
    seg = None if q_seg is None else (pad_ids(q_seg), pad_ids(k_seg))
    rows = ((0, 0), (0, 0), (0, cfg.padded_len - s))
    # the kernels' L is base 2 with +inf for an empty row (exp2(x - inf) = 0); padded rows are empty too
    lse2 = jnp.pad(jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2_E), rows, constant_values=jnp.inf)
    delta = jnp.pad(delta.astype(jnp.float32), rows)
    q, k, v, do = pad(q), pad(k), pad(v), pad(do.astype(q.dtype))
    dk, dv = _backward_dkv(q, k, v, seg, do, lse2, delta, cfg)
    dq = _backward_dq(q, k, v, seg, do, lse2, delta, cfg)
    return dq[:, :s, :, :d], dk[:, :s, :, :d], dv[:, :s, :, :d]


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
