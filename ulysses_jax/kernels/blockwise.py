"""Blockwise exact attention in plain ``jnp`` / ``lax``: forward and backward, causal, packed documents, MHA/GQA/MQA.

The fast exact path for CPUs (``attention(impl="blockwise")``, what ``impl="auto"`` picks off GPUs). The
reference (``impl="xla"``) materialises ``[B, H, S, S]`` scores and computes every one of them; this
computes only the blocks a query block can see, and never holds more than one ``[Bq, Bk]`` tile of scores
per head.

Layout inside: ``q [B, K, G, S, D]``, ``k, v [B, K, S, D]`` (``K`` KV heads, ``G = H // K`` query heads
per KV head, so GQA/MQA read each KV head once, never repeated in memory); ``Bq`` / ``Bk`` are the query
and key block sizes. Everything is computed in float32 whatever the input dtype.

Algorithm (FlashAttention-2's, written with ``lax`` loops instead of a kernel):
  forward   ``lax.map`` over query blocks; for each, a ``fori_loop`` over the KV blocks it can see keeps
            an online softmax (running max ``m``, denominator ``l``, numerator ``acc``); writes ``O`` and the
            log-sum-exp ``L`` (natural log).
  backward  ``delta = rowsum(dO * O)``, then one ``scan`` over KV blocks; for each, a ``fori_loop`` over
            the query blocks that can see it recomputes ``P = exp(S - L)`` tile by tile and accumulates
            dK, dV in the loop carry and dQ in place in a full-size carry (on a CPU nothing forces
            FlashAttention-2's separate dQ pass, so ``P`` is recomputed once, not twice).
Skipping (:func:`_live_blocks`): a block pair is visited only if it can hold an allowed (query, key)
pair: causal (the KV block starts at or before the query block's last row), not all padding, and,
with segment ids, the ``[min, max]`` id ranges of the two blocks overlap for some batch row; with a sliding
window (``kernels/window.py``), the KV block's last key is inside the query block's first row's window. Each query
block visits the span from its first to its last live KV block (and each KV block the span of query
blocks), which for packed documents (ids constant along a document) is exactly the live set. Every
visited tile also applies the elementwise mask, so skipping only drops tiles that are entirely masked:
the result does not depend on the block sizes beyond float32 summation order.
Attention sinks (``kernels/sinks.py``): the online softmax starts from the sink (running max ``m = sink``,
``l = 1``), a key of value zero; the backward is unchanged given the corrected ``L`` and output, plus the sinks'
own gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ulysses_jax.kernels.sinks import check_sinks, sink_grad, vary_like
from ulysses_jax.kernels.window import check_window

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(MASK - m) underflows to 0, never NaN
_HIGHEST = lax.Precision.HIGHEST  # float32 products everywhere (no TF32 if this ever runs on a GPU)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes, powers of two; larger than the (power-of-two rounded) sequence, they shrink to it.

    The default was measured on a 2-core CPU for the tiny model's per-device attention (S = 2048,
    D = 32, 2 query heads per KV head): see ``experiments/results/make_train_cpu.md``.
    """

    block_q: int = 256
    block_k: int = 256


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff argument)."""

    causal: bool
    scale: float
    seq_len: int  # valid length; positions seq_len..padded_len-1 are padding
    padded_len: int
    block_q: int
    block_k: int
    window: int | None = None  # sliding window (kernels/window.py); None: full
    offset: int = 0  # query row i sits at position i + offset of the keys' frame (a ring pair); 0: aligned

    @property
    def padded(self) -> bool:
        return self.padded_len != self.seq_len


# ---------------------------------------------------------------------------------------------------
# Which tiles to visit, and the mask inside a tile
# ---------------------------------------------------------------------------------------------------


def _qk_segments(seg):
    """``seg`` is one ``[B, S]`` array for queries and keys alike, or a pair ``(query ids, key ids)`` (ring steps)."""
    return (None, None) if seg is None else tuple(seg) if isinstance(seg, (tuple, list)) else (seg, seg)


def _live_blocks(seg, cfg: _Config) -> jax.Array:
    """Boolean ``[nq, nk]``: may query block ``i`` see anything of KV block ``j``? (see module docstring)."""
    bq, bk, n = cfg.block_q, cfg.block_k, cfg.padded_len
    q_first = jnp.arange(n // bq)[:, None] * bq + cfg.offset  # position of each query block's first row
    k_start = jnp.arange(n // bk)[None, :] * bk
    live = jnp.broadcast_to(k_start < cfg.seq_len, (n // bq, n // bk))
    if cfg.causal:
        live = live & (k_start <= q_first + bq - 1)
    if cfg.window is not None:  # the block's last key inside its first row's window
        live = live & (k_start + bk - 1 > q_first - cfg.window)
    if seg is not None:
        q_seg, k_seg = _qk_segments(seg)
        sq, sk = q_seg.reshape(q_seg.shape[0], -1, bq), k_seg.reshape(k_seg.shape[0], -1, bk)
        q_min, q_max = sq.min(-1)[:, :, None], sq.max(-1)[:, :, None]  # [B, nq, 1]
        k_min, k_max = sk.min(-1)[:, None, :], sk.max(-1)[:, None, :]  # [B, 1, nk]
        live = live & ((q_min <= k_max) & (k_min <= q_max)).any(0)
    return live


def _span(live) -> tuple[jax.Array, jax.Array]:
    """Per row of ``live [n, m]``: ``[lo, hi)`` from the first to one past the last True (``lo == hi`` if none)."""
    m = live.shape[1]
    lo = jnp.argmax(live, axis=1).astype(jnp.int32)
    hi = (m - jnp.argmax(live[:, ::-1], axis=1)).astype(jnp.int32)
    return lo, jnp.where(live.any(1), hi, lo)


def _tile_mask(i, j, seg, cfg: _Config):
    """Allowed (query, key) pairs of tile ``(i, j)``, broadcastable to ``[B, K, G, Bq, Bk]``; None if all are."""
    bq, bk = cfg.block_q, cfg.block_k
    q_pos = i * bq + cfg.offset + jnp.arange(bq)[:, None]
    k_pos = j * bk + jnp.arange(bk)[None, :]
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if cfg.causal:
        mask = q_pos >= k_pos
    if cfg.window is not None:
        mask = both(mask, q_pos - k_pos < cfg.window)
    if cfg.padded:
        mask = both(mask, k_pos < cfg.seq_len)
    mask = None if mask is None else mask[None, None, None]
    if seg is not None:
        q_ids, k_ids = _qk_segments(seg)
        q_seg = lax.dynamic_slice_in_dim(q_ids, i * bq, bq, axis=1)
        k_seg = lax.dynamic_slice_in_dim(k_ids, j * bk, bk, axis=1)
        mask = both(mask, (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None])
    return mask


def _scores(q_i, k_j, mask):
    """Masked logits ``[B, K, G, Bq, Bk]`` (``q`` comes pre-scaled)."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", q_i, k_j, precision=_HIGHEST)
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------


def _forward(q, k, v, seg, cfg: _Config, sinks=None):
    """q [B, K, G, S, D] (pre-scaled), k/v [B, K, S, D], seg [B, S] | None, float32, sinks [H] | None ->
    (O [B, K, G, S, D], L [B, K, G, S])."""
    bq, bk = cfg.block_q, cfg.block_k
    lo, hi = _span(_live_blocks(seg, cfg))
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, q.shape[1], q.shape[2], 1)

    def q_block(i):
        q_i = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)  # [B, K, G, Bq, D]

        def kv_step(j, carry):
            acc, m, l = carry  # [B, K, G, Bq, D], [B, K, G, Bq], [B, K, G, Bq]
            k_j = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
            v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
            s = _scores(q_i, k_j, _tile_mask(i, j, seg, cfg))
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
            p = jnp.exp(s - m_new[..., None])
            acc = alpha[..., None] * acc + jnp.einsum("bkgqs,bksd->bkgqd", p, v_j, precision=_HIGHEST)
            return acc, m_new, alpha * l + p.sum(-1)

        # *_like: the carries inherit q's varying mesh axes inside shard_map (check_vma)
        init = (jnp.zeros_like(q_i), jnp.full_like(q_i[..., 0], -jnp.inf), jnp.zeros_like(q_i[..., 0]))
        if sink is not None:  # the sink: one more logit, whose value vector is zero (a -inf sink: none)
            zeros = init[2]  # [B, K, G, Bq]
            init = (init[0], zeros + sink, zeros + jnp.where(sink == -jnp.inf, 0.0, 1.0))
        acc, m, l = lax.fori_loop(lo[i], hi[i], kv_step, init)
        # A row that saw no allowed key (none can today: every token sees itself) gets O = 0 and L = +inf,
        # so the backward's exp(S - L) is 0 for it. `m <= MASK` (not `not m > MASK`) lets NaN propagate.
        empty = m <= MASK_VALUE
        l = jnp.where(empty, 1.0, l)
        return jnp.where(empty[..., None], 0.0, acc / l[..., None]), jnp.where(empty, jnp.inf, m + jnp.log(l))

    o, lse = lax.map(q_block, jnp.arange(cfg.padded_len // bq))  # [nq, B, K, G, Bq, D], [nq, B, K, G, Bq]
    b, kh, g = q.shape[:3]
    o = jnp.moveaxis(o, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, cfg.padded_len)
    return o, lse


# ---------------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit_blocks(blocks: BlockSizes, seq_len: int) -> BlockSizes:
    """Validate block sizes (powers of two) and shrink those larger than the power-of-two rounded sequence."""
    cap = _next_pow2(seq_len)
    for name in ("block_q", "block_k"):
        size = getattr(blocks, name)
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name}={size} must be a power of two")
    return BlockSizes(min(blocks.block_q, cap), min(blocks.block_k, cap))


def _config(seq_len: int, *, causal: bool, scale: float, block_sizes: BlockSizes | None, window: int | None = None,
            offset: int = 0) -> _Config:
    blocks = _fit_blocks(block_sizes or BlockSizes(), seq_len)
    multiple = max(blocks.block_q, blocks.block_k)
    return _Config(causal=bool(causal), scale=float(scale), seq_len=seq_len,
                   padded_len=-(-seq_len // multiple) * multiple, block_q=blocks.block_q, block_k=blocks.block_k,
                   window=window, offset=int(offset))


def _pad_segments(segment_ids, cfg: _Config):
    """``[B, S] -> [B, S_pad]`` int32; padding repeats the last id, so the blocks' id ranges stay tight (padded
    keys are masked by length, padded queries are dropped)."""
    if segment_ids is None:
        return None
    return jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, cfg.padded_len - cfg.seq_len)), mode="edge")


def visited_tiles(seq_len: int, *, causal: bool = True, segment_ids=None,
                  block_sizes: BlockSizes | None = None, window: int | None = None) -> jax.Array:
    """Boolean ``[nq, nk]``: the (query block, KV block) tiles the forward pass computes; the rest it skips.

    For inspection and tests: ``visited_tiles(...).mean()`` is the fraction of the dense work done.
    """
    cfg = _config(seq_len, causal=causal, scale=1.0, block_sizes=block_sizes,
                  window=check_window(window, causal=causal))
    lo, hi = _span(_live_blocks(_pad_segments(segment_ids, cfg), cfg))
    j = jnp.arange(cfg.padded_len // cfg.block_k)[None, :]
    return (lo[:, None] <= j) & (j < hi[:, None])


def blockwise_attention(q, k, v, *, causal: bool = True, segment_ids=None, scale=None,
                        block_sizes: BlockSizes | None = None, window: int | None = None, sinks=None):
    """Exact attention computed tile by tile, skipping tiles that are entirely masked.

    q: [B, S, H, D]; k, v: [B, S, Hkv, D] with H % Hkv == 0 (MHA, GQA, MQA). segment_ids: [B, S] integers or
    None: a token attends only to tokens with the same id (packed documents), and when ``causal`` not to later
    positions; ``window``: a causal sliding window (``kernels/window.py``); ``sinks``: ``[H]`` attention-sink logits
    (``kernels/sinks.py``) or None. scale defaults to 1/sqrt(D). Any S
    (padded to a block multiple inside, padded keys masked).
    Softmax and all products in float32; returns [B, S, H, D] in q.dtype, gradients in the inputs' dtypes.
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B,S,H,D] and k, v [B,S,Hkv,D]; got {q.shape=}, {k.shape=}, {v.shape=}")
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(f"k/v batch, sequence and head_dim must match q: {q.shape=}, {k.shape=}")
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be divisible by kv heads ({hkv})")
    if segment_ids is not None and segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must have shape {(b, s)}; got {segment_ids.shape}")
    sinks = check_sinks(sinks, h)
    sinks = None if sinks is None else vary_like(sinks, q)
    cfg = _config(s, causal=causal, scale=1.0 / math.sqrt(d) if scale is None else scale, block_sizes=block_sizes,
                  window=check_window(window, causal=causal))
    s_pad = cfg.padded_len

    def prepare(x):  # [B, S, heads, D] -> float32 [B, heads, S_pad, D]
        x = jnp.swapaxes(x.astype(jnp.float32), 1, 2)
        return x if s_pad == s else jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))

    q_t = (prepare(q) * cfg.scale).reshape(b, hkv, h // hkv, s_pad, d)  # [B, K, G, S_pad, D], pre-scaled
    out = _blockwise(q_t, prepare(k), prepare(v), _pad_segments(segment_ids, cfg), sinks, cfg)  # [B, K, G, S_pad, D]
    return jnp.swapaxes(out.reshape(b, h, s_pad, d)[:, :, :s], 1, 2).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blockwise(q, k, v, seg, sinks, cfg: _Config):
    return _forward(q, k, v, seg, cfg, sinks)[0]


def _blockwise_fwd(q, k, v, seg, sinks, cfg: _Config):
    out, lse = _forward(q, k, v, seg, cfg, sinks)
    return out, (q, k, v, seg, sinks, out, lse)


def _blockwise_bwd(cfg: _Config, res, do):
    q, k, v, seg, sinks, out, lse = res
    if sinks is None:
        dq, dk, dv = _backward(q, k, v, seg, out, lse, do, cfg)
        return dq, dk, dv, None, None
    delta = jnp.sum(do * out, axis=-1)  # [B, K, G, S]: out and lse have the sink in them
    dq, dk, dv = _backward(q, k, v, seg, None, lse, do, cfg, delta=delta)
    b, kh, g, s_pad = lse.shape
    return dq, dk, dv, None, sink_grad(sinks, lse.reshape(b, kh * g, s_pad), delta.reshape(b, kh * g, s_pad))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------


def _backward(q, k, v, seg, out, lse, do, cfg: _Config, delta=None):
    """Gradients with respect to the pre-scaled ``q`` and to ``k``, ``v`` (layouts as in :func:`_forward`);
    ``delta`` given (a ring step: the global output's), ``out`` is not read."""
    bq, bk = cfg.block_q, cfg.block_k
    delta = jnp.sum(do * out, axis=-1) if delta is None else delta  # [B, K, G, S] = rowsum(P * dP)
    lo, hi = _span(_live_blocks(seg, cfg).T)  # per KV block: the query blocks that can see it

    def kv_block(dq, j):
        k_j = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)  # [B, K, Bk, D]
        v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)

        def q_step(i, carry):
            dq, dk, dv = carry
            q_i, do_i, dq_i = (lax.dynamic_slice_in_dim(x, i * bq, bq, axis=3) for x in (q, do, dq))
            lse_i, delta_i = (lax.dynamic_slice_in_dim(x, i * bq, bq, axis=3)[..., None] for x in (lse, delta))
            p = jnp.exp(_scores(q_i, k_j, _tile_mask(i, j, seg, cfg)) - lse_i)  # [B, K, G, Bq, Bk]
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, do_i, precision=_HIGHEST)  # GQA: summed over G here
            ds = p * (jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, precision=_HIGHEST) - delta_i)
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_i, precision=_HIGHEST)
            dq_i = dq_i + jnp.einsum("bkgqs,bksd->bkgqd", ds, k_j, precision=_HIGHEST)
            return lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, axis=3), dk, dv

        zeros = jnp.zeros_like(k_j)
        dq, dk, dv = lax.fori_loop(lo[j], hi[j], q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(kv_block, jnp.zeros_like(q), jnp.arange(cfg.padded_len // bk))
    dk, dv = (jnp.moveaxis(x, 0, 2).reshape(k.shape) for x in (dk, dv))  # [nk, B, K, Bk, D] -> [B, K, S, D]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------


def reference(q, k, v, *, causal=True, segment_ids=None, scale=None):
    """Plain jnp attention with a float32 softmax; materialises [B, H, S, S]. Same contract as
    :func:`blockwise_attention`."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision=_HIGHEST) * scale
    mask = jnp.ones((b, 1, s, s), dtype=bool)
    if causal:
        mask &= jnp.tril(jnp.ones((s, s), dtype=bool))
    if segment_ids is not None:
        mask &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    probs = jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=_HIGHEST).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------
# One ring step: separate query and key segment ids, the log-sum-exp out, the global one in
# ---------------------------------------------------------------------------------------------------


def _pair_inputs(q, k, v, q_seg, k_seg, *, causal: bool, scale: float, window=None, offset=0):
    b, s, h, d = q.shape
    hkv = k.shape[2]
    cfg = _config(s, causal=causal, scale=scale, block_sizes=None, window=window, offset=offset)
    s_pad = cfg.padded_len

    def prepare(x):  # [B, S, heads, D] -> float32 [B, heads, S_pad, D]
        x = jnp.swapaxes(x.astype(jnp.float32), 1, 2)
        return x if s_pad == s else jnp.pad(x, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))

    q_t = (prepare(q) * cfg.scale).reshape(b, hkv, h // hkv, s_pad, d)
    seg = None if q_seg is None else (_pad_segments(q_seg, cfg), _pad_segments(k_seg, cfg))
    return cfg, q_t, prepare(k), prepare(v), seg, prepare


def pair_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool, scale: float, window=None, offset: int = 0,
                 sinks=None):
    """The ring's local kernel contract (``ring.LocalKernel.forward``) for a (query block, KV block) pair of
    equal lengths whose causal mask, when ``causal``, is the aligned one: ``o [B, S, H, D]`` float32 and
    ``lse [B, H, S]`` float32, natural log, ``-inf`` for a row that sees no key. ``q_pos`` / ``k_pos`` are
    not read (the ring asks ``causal`` only where they coincide, or differ by the static ``offset``: query row ``i``
    at key position ``i + offset``, with a ``window``). ``sinks [H]``: in the softmax, ``o`` and ``lse`` alike."""
    b, s, h, d = q.shape
    cfg, q_t, k_t, v_t, seg, _ = _pair_inputs(q, k, v, q_seg, k_seg, causal=causal, scale=scale, window=window,
                                              offset=offset)
    o, lse = _forward(q_t, k_t, v_t, seg, cfg, sinks)  # [B, K, G, S_pad, D], [B, K, G, S_pad]; +inf for empty rows
    o = jnp.swapaxes(o.reshape(b, h, cfg.padded_len, d)[:, :, :s], 1, 2)
    lse = lse.reshape(b, h, cfg.padded_len)[:, :, :s]
    return o, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def pair_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, do, lse, delta, *, causal: bool, scale: float, window=None,
                  offset: int = 0):
    """``ring.LocalKernel.backward``: float32 ``dq, dk, dv`` of one pair given the global ``lse`` and
    ``delta [B, H, S]`` (``rowsum(dO * O)`` of the global output)."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    cfg, q_t, k_t, v_t, seg, prepare = _pair_inputs(q, k, v, q_seg, k_seg, causal=causal, scale=scale,
                                                    window=window, offset=offset)
    pad = cfg.padded_len - s

    def rows(x, fill):  # [B, H, S] -> [B, K, G, S_pad]
        x = x if pad == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=fill)
        return x.reshape(b, hkv, h // hkv, cfg.padded_len)

    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # a row that sees nothing: exp(S - inf) = 0
    do_t = prepare(do).reshape(q_t.shape)
    dq, dk, dv = _backward(q_t, k_t, v_t, seg, None, rows(lse, jnp.inf), do_t, cfg, delta=rows(delta, 0.0))
    dq = jnp.swapaxes(dq.reshape(b, h, cfg.padded_len, d)[:, :, :s], 1, 2) * cfg.scale  # q was pre-scaled
    dk, dv = (jnp.swapaxes(x[:, :, :s], 1, 2) for x in (dk, dv))
    return dq, dk, dv
