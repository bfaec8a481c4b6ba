"""The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) in chunks (its short convolution: ``short_conv.py``).

Per value head, a state ``S [dk, dv]`` starts at zero and each token ``t`` of a document updates it and reads it::

    S <- exp(g_t) S                                  decay (g_t <= 0, a log factor)
    S <- S + beta_t k_t (v_t - S^T k_t)^T            delta rule: write the part of v_t that S does not predict
    o_t = S^T q_t

with ``q``, ``k`` L2-normalised over ``dk`` (``x * rsqrt(sum x^2 + 1e-6)``, ``use_qk_l2norm``, as the Hugging Face
layer asks with ``use_qk_l2norm_in_kernel=True``) and ``q`` always scaled by ``dk ** -0.5``. The gates come from the
layer's parameters through :func:`gates`: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.
Layout ``[batch, seq, heads, dim]``: ``q, k [B, S, Hk, dk]``, ``v [B, S, Hv, dv]``, ``g, beta [B, S, Hv]``; value
head ``h`` reads key head ``h // (Hv // Hk)`` (transformers' ``repeat_interleave``), never repeated in memory here.
``segment_ids [B, S]``: a document is a run of equal ids; the state restarts from zero where the id changes.

Chunked form (:func:`gated_delta_rule`), chunks of ``C`` tokens (64 by default). Within a chunk, with ``gc`` the
cumulative ``g``, ``D[i, j] = exp(gc_i - gc_j)`` for ``j <= i`` in one document (else 0) and ``Gam_i = exp(gc_i)``
if token ``i`` is still in the document the chunk's incoming state ``S0`` belongs to (else 0), the delta rule's
corrected values are ``u = U - W S0`` where ``[U | W] = T [beta v | beta Gam k]``, ``T = (I + strict_lower(diag(beta)
K K^T * D))^-1`` (the WY / UT representation; ``T`` by :func:`unit_lower_inverse`). Then, chunk by chunk::

    o   = (Gam q) S0 + (Q K^T * D) u                     S' = Gam_last S0 + (K * D[last, :])^T u

Document boundaries are those zeros of ``D`` and ``Gam`` (a log decay of -inf across a boundary). The chunks are
grouped in blocks of about ``block`` chunks (64: 4,096 tokens): a ``lax.scan`` over blocks slices each block out of
the inputs, computes its intra-chunk parts for all its chunks at once (:func:`_intra`: batched matmuls), scans its
chunks carrying only the ``[dk, dv]`` state (:func:`_step`) and writes its rows of the output in place. A sequence
that is not a multiple of the blocks is padded at the end (under one chunk per block, plus the last chunk's) with
tokens of ``q = k = v = 0``, ``beta = 0``, ``g = 0``, which leave the state unchanged. Everything is computed in
float32 (float64 for float64 inputs), matmuls at HIGHEST precision; the output has ``q``'s dtype.

Memory. Nothing per token of size ``dk * dv`` exists. Beyond the inputs and an output-sized buffer, the forward
holds one block's intra-chunk parts (``O(block * C * (dk + dv + C))`` per value head) and the ``[dk, dv]`` state.
The gradient is a ``custom_vjp`` whose residuals are the inputs themselves and one state per block (``[S / (C *
block), dk, dv]`` float32). Its backward walks the blocks in reverse carrying ``dL/dS``; per block it recomputes the
intra-chunk parts and the chunk-start states (one more forward scan over the block's chunks), walks its chunks in
reverse, and writes the block's rows of ``dq, dk, dv, dg, dbeta`` in place; each piece (a block's intra part, one
chunk step) is differentiated by ``jax.vjp``, so the gradients are those of the very computation the forward runs.
Compiled on a CPU for one head, ``dk = dv = 128``, float32, ``S = 262,144``: temporaries of 1.1 (forward) and 1.5
(forward + backward) times one ``[S, 128]`` float32 array; autodiff through the same forward without the
``custom_vjp``: 21.4 times, its intra-chunk parts kept for the whole sequence. (With bfloat16 inputs XLA's CPU
backend adds float32 copies around the in-place writes; other backends were not measured.)

FLOPs (:func:`gated_delta_flops`): the forward costs per token and value head
``4 C dk / n + 2 C^2 / 3 + 2 C (dk + dv) + 2 C dv + 6 dk dv`` (``n = Hv / Hk``: ``q k^T``, ``k k^T`` are per key
head), about 183k at ``C = 64``, ``dk = dv = 128``, ``n = 1``; forward + backward about 3.9 times that (the intra
part and the chunk states recomputed). Measured on a loaded 2-core CPU (float32, ``S = 16,384``, 2 heads): about
20 GFLOP/s forward, 18 forward + backward. On one H100 (2026-11-27; bf16 inputs, ``S = 32,768``, 16 key / 32 value
heads of 128): 101.0 ms forward + backward, 6.7 TFLOP/s, by its reading launch-bound (22,227 kernels per call:
``experiments/delta_launches.py``). ``impl="pallas"`` walks each block's chunks in two Pallas kernels instead of a
``lax.scan`` (``gated_delta_scan.py``; 1,242 launches at that shape; not yet timed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ulysses_jax.kernels import gated_delta_scan

CHUNK = 64  # tokens per chunk: the C x C intra-chunk products against the [dk, dv] state products per chunk
BLOCK = 64  # chunks per block: the unit of the intra-chunk temporaries (4,096 tokens at the default chunk)
BLOCK_STATES = "delta_block_states"  # checkpoint_name of the backward's residual states (``[S / (C * block), dk, dv]``)
L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon, inside the square root
_mm = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
PRECISIONS = ("highest", "bf16")
IMPLS = ("xla", "pallas")  # the walk over a block's chunks: a lax.scan, or gated_delta_scan's two Pallas kernels


_dot = gated_delta_scan.chunk_product  # a chunk product at HIGHEST precision, or bf16 operands (``low``)


@dataclasses.dataclass(frozen=True)
class Scan:
    """The Pallas walk over chunks (``impl="pallas"``): its blocks and whether it runs in interpret mode."""

    blocks: gated_delta_scan.ScanBlocks = gated_delta_scan.ScanBlocks()
    interpret: bool = True


def compute_dtype(*dtypes):
    """float32 for 16- and 32-bit inputs, float64 when one input is float64."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last axis (transformers' ``l2norm``; a zero vector stays zero)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(g, beta)`` from the layer's projections ``a, b [B, S, Hv]`` and per-head ``A_log, dt_bias [Hv]``.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay, <= 0), ``beta = sigmoid(b)``, both float32 (float64 for
    float64 inputs). transformers computes ``g`` in float32 too but ``beta`` in ``b``'s dtype."""
    f = compute_dtype(a.dtype, b.dtype, A_log.dtype, dt_bias.dtype)
    g = -jnp.exp(A_log.astype(f)) * jax.nn.softplus(a.astype(f) + dt_bias.astype(f))
    return g, jax.nn.sigmoid(b.astype(f))


def document_index(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """``[B, S]`` int32: 0 for the first run of equal ids of a row, +1 at every change of id (so two separate runs
    of one id are two documents); all zeros without segment ids."""
    if segment_ids is None:
        return jnp.zeros((batch, seq), jnp.int32)
    seg = jnp.asarray(segment_ids)
    if seg.shape != (batch, seq):
        raise ValueError(f"segment_ids has shape {seg.shape}; it must be [batch, seq] = {(batch, seq)}")
    change = jnp.concatenate([jnp.zeros((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return jnp.cumsum(change, axis=1, dtype=jnp.int32)


def gated_delta_flops(seq: int, dk: int, dv: int, chunk: int = CHUNK, block: int = BLOCK, *,
                      value_per_key: int = 1, backward: bool = False) -> int:
    """Matmul FLOPs of :func:`gated_delta_rule` for one value head over ``seq`` tokens (padded as it pads them).

    ``value_per_key``: ``Hv // Hk`` (the ``q k^T`` and ``k k^T`` blocks are shared by that many value heads).
    ``backward``: forward + backward: the intra part again and its vjp (about 2x), the chunk states again (``W S0``,
    ``K^T u``), ``u`` again in each step's vjp and the step's vjp (2x). Elementwise work is left out."""
    c, tokens = chunk, seq + blocking(seq, chunk, block)[2]
    # q k^T, k k^T; the inverse of the triangular system, applied to beta v and beta Gam k
    intra = 4 * c * dk // value_per_key + 2 * c * c // 3 + 2 * c * (dk + dv)
    step = 2 * c * dv + 6 * dk * dv  # (q k^T * D) u; W S0, (Gam q) S0, (K D)^T u
    return tokens * (4 * intra + 3 * step + 6 * dk * dv if backward else intra + step)


# ---------------------------------------------------------------------------------------------------
# Kernel: the intra-chunk parts (all chunks of a block at once), one step of the scan over chunks, a block
# ---------------------------------------------------------------------------------------------------


def _intra(q, k, v, g, beta, doc, prev, use_qk_l2norm: bool, low: bool = False):
    """The per-chunk quantities the scan consumes, for the ``M`` chunks of a block (``C`` tokens each)::

        q, k [M, B, Hk, C, dk]   v [M, B, Hk, n, C, dv]   g, beta [M, B, Hk, n, C]   doc [M, B, C]   prev [M, B]

    (``prev``: the document of the token before each chunk, the one its incoming state belongs to). Returns ``(U, W,
    A, Qg, Kd, gam_last)``: ``U [.., C, dv]`` and ``W [.., C, dk]`` (``u = U - W S0``), ``A = Q K^T * D [.., C,
    C]``, ``Qg = Gam q``, ``Kd = K * D[last, :]`` (``[.., C, dk]``), ``gam_last [M, B, Hk, n]``, every one with
    leading ``[M, B, Hk, n]``."""
    f = compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    q, k, v, g, beta = (x.astype(f) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    c = q.shape[-2]
    gc = jnp.cumsum(g, axis=-1)
    same = (doc[..., :, None] == doc[..., None, :]) & jnp.tril(jnp.ones((c, c), bool))  # [M, B, C, C]
    # exp of a log decay that is <= 0 wherever it is kept; -inf elsewhere (exp -> 0, gradient 0, never inf * 0)
    decay = jnp.exp(jnp.where(same[:, :, None, None], gc[..., :, None] - gc[..., None, :], -jnp.inf))
    gam = jnp.exp(jnp.where((doc == prev[..., None])[:, :, None, None], gc, -jnp.inf))  # [M, B, Hk, n, C]
    to_end = jnp.exp(jnp.where((doc == doc[..., -1:])[:, :, None, None], gc[..., -1:] - gc, -jnp.inf))
    kk = _dot("mbhid,mbhjd->mbhij", k, k, low)[:, :, :, None]  # [M, B, Hk, 1, C, C], shared by the n value heads
    qk = _dot("mbhid,mbhjd->mbhij", q, k, low)[:, :, :, None]
    t = unit_lower_inverse(jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), kk * decay * beta[..., :, None], 0))
    k = k[:, :, :, None]  # [M, B, Hk, 1, C, dk], broadcast over the n value heads
    u = _dot("...ij,...jd->...id", t, beta[..., None] * v, low)
    w = _dot("...ij,...jd->...id", t, (beta * gam)[..., None] * k, low)
    return u, w, qk * decay, q[:, :, :, None] * gam[..., None], k * to_end[..., None], gam[..., -1]


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """``(I + lower)^-1`` for a strictly lower-triangular ``lower [..., C, C]``, in batched matmuls.

    Doubling over the diagonal blocks: with the inverses ``A^-1``, ``D^-1`` of two neighbouring diagonal blocks of
    size ``s``, the inverse of the ``2s`` block they make with the block ``X`` below ``A`` is ``[[A^-1, 0], [-D^-1 X
    A^-1, D^-1]]`` (the standard recursive triangular inversion; no power series, so no cancellation between large
    terms). ``log2 C`` steps, ``2 C^3 / 3`` FLOPs; ``C`` is padded to a power of two with an identity block.
    (XLA's batched ``triangular_solve`` on a CPU measured from 0.03 s to minutes for the same shapes.)"""
    c = lower.shape[-1]
    p = 1 << max(0, (c - 1).bit_length())
    lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, p - c)] * 2) if p != c else lower
    batch = lower.shape[:-2]
    inv, s = jnp.ones((*batch, p, 1, 1), lower.dtype), 1  # the inverses of the 1 x 1 diagonal blocks
    while s < p:
        pairs = p // (2 * s)
        # rows of each pair's second block against columns of every pair's first block; keep each pair's own
        cross = lower.reshape(*batch, pairs, 2, s, pairs, 2, s)[..., :, 1, :, :, 0, :]
        x = jnp.sum(jnp.where(jnp.eye(pairs, dtype=bool)[:, None, :, None], cross, 0), axis=-2)  # [.., pairs, s, s]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x = -_mm("...ij,...jk->...ik", d_inv, _mm("...ij,...jk->...ik", x, a_inv))
        inv = jnp.concatenate([jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1),
                               jnp.concatenate([x, d_inv], axis=-1)], axis=-2)
        s *= 2
    return inv.reshape(*batch, p, p)[..., :c, :c]


def _step(state, parts, low: bool = False):
    """One chunk: ``state [B, Hk, n, dk, dv]`` in, ``(state after the chunk, o [B, Hk, n, C, dv])`` out (the state
    carried in float32 whatever ``low``)."""
    u, w, a, qg, kd, gam_last = parts
    u = u - _dot("...ck,...kv->...cv", w, state, low)
    o = _dot("...ck,...kv->...cv", qg, state, low) + _dot("...ij,...jv->...iv", a, u, low)
    return gam_last[..., None, None] * state + _dot("...ck,...cv->...kv", kd, u, low), o


def _block_parts(q, k, v, g, beta, doc, prev, m: int, c: int, use_qk_l2norm: bool, low: bool = False):
    """:func:`_intra` of one block of ``M`` chunks given token-major: ``q, k [B, M C, Hk, dk]``, ``v [B, M C, Hk, n,
    dv]``, ``g, beta [B, M C, Hk, n]``, ``doc [B, M C]``, ``prev [B, M]``."""
    def chunked(x, *order):  # [B, M C, ...] -> [M, B, ...] with the token axis at `order`'s place
        return x.reshape(x.shape[0], m, c, *x.shape[2:]).transpose(1, 0, *order)

    q, k = chunked(q, 3, 2, 4), chunked(k, 3, 2, 4)
    g, beta = chunked(g, 3, 4, 2), chunked(beta, 3, 4, 2)
    return _intra(q, k, chunked(v, 3, 4, 2, 5), g, beta, chunked(doc, 2), prev.T, use_qk_l2norm, low)


def _block(x, i, length: int):
    """Block ``i`` (``length`` tokens) of a ``[B, T, ...]`` array."""
    return lax.dynamic_slice_in_dim(x, i * length, length, axis=1)


def _blocks(xs, i, length: int):
    """:func:`_block` of each of ``xs``, behind an optimisation barrier: without it XLA (CPU, measured) converts
    whole bf16 inputs to float32 once before the loop, a float32 copy of each input instead of one block's."""
    return lax.optimization_barrier(tuple(_block(x, i, length) for x in xs))


def _walk(state, parts, low: bool, scan: Scan | None):
    """A block's chunks in order (``lax.scan`` of :func:`_step`, or with ``scan`` the Pallas kernel): ``(state after
    the block, o [M, B, Hk, n, C, dv])``."""
    if scan is None:
        return lax.scan(functools.partial(_step, low=low), state, parts)
    new, o, _ = gated_delta_scan.scan_forward(_heads(state, 0), tuple(_heads(x, 1) for x in parts), low=low,
                                              blocks=scan.blocks, interpret=scan.interpret)
    return new.reshape(state.shape), o.reshape(parts[0].shape)


def _heads(x, axis: int):
    """``[.., B, Hk, n, ..]`` (batch at ``axis``) -> ``[.., B Hk n, ..]``: the Pallas scan's flat head axis."""
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 3:])


def _forward(inputs, m: int, c: int, use_qk_l2norm: bool, keep_block_states: bool, low: bool = False,
             scan: Scan | None = None):
    """``inputs = (q, k, v, g, beta, doc, prev)`` token-major (:func:`_block_parts`, over the whole padded length
    ``T``; ``prev [B, T / C]``): a scan over blocks, each computing its intra-chunk parts, walking its chunks
    (:func:`_walk`) and writing its rows of ``o [B, T, Hk, n, dv]`` (``q``'s dtype) in place. With
    ``keep_block_states``, also each block's incoming state ``[NB, B, Hk, n, dk, dv]``."""
    q, v, g, prev = inputs[0], inputs[2], inputs[3], inputs[6]
    (b, t, hk, n), length = g.shape, m * c
    f = compute_dtype(*(x.dtype for x in inputs[:5]))

    def body(carry, i):
        state, out = carry
        parts = _block_parts(*_blocks(inputs[:6], i, length), _block(prev, i, m), m, c, use_qk_l2norm, low)
        new, o = _walk(state, parts, low, scan)  # o [M, B, Hk, n, C, dv]
        o = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, length, hk, n, v.shape[-1]).astype(out.dtype)
        return (new, lax.dynamic_update_slice_in_dim(out, o, i * length, axis=1)), (state if keep_block_states else
                                                                                      None)

    init = (jnp.zeros((b, hk, n, q.shape[-1], v.shape[-1]), f), jnp.zeros(v.shape, q.dtype))
    (_, out), states = lax.scan(body, init, jnp.arange(t // length))
    return out, states


# ---------------------------------------------------------------------------------------------------
# Public wrapper, differentiable (custom_vjp on the token-major core)
# ---------------------------------------------------------------------------------------------------


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     segment_ids: jax.Array | None = None, chunk: int = CHUNK, block: int = BLOCK,
                     use_qk_l2norm: bool = True, precision: str = "highest", impl: str = "xla",
                     interpret: bool | None = None, scan_blocks: gated_delta_scan.ScanBlocks | None = None
                     ) -> jax.Array:
    """The gated delta rule over whole sequences, chunked (see the module docstring); ``o [B, S, Hv, dv]``.

    ``q, k [B, S, Hk, dk]``, ``v [B, S, Hv, dv]`` (``Hv`` a multiple of ``Hk``), ``g, beta [B, S, Hv]`` (from
    :func:`gates`), ``segment_ids [B, S]`` or None. ``chunk`` tokens per chunk, about ``block`` chunks per block.
    ``use_qk_l2norm`` L2-normalises ``q`` and ``k`` here (transformers' ``use_qk_l2norm_in_kernel``, which its layer
    always sets); ``q`` is scaled by ``dk ** -0.5`` either way. Differentiable in ``q, k, v, g, beta``.
    ``precision``: ``"highest"`` (every product float32 at HIGHEST precision: the default, the one measured on an H100
    at 6.7 TFLOP/s) or ``"bf16"`` (the chunk products on bfloat16 operands with float32 results, the state and the
    triangular inverse float32, as flash-linear-attention computes; not yet timed on a GPU:
    ``experiments/bench_delta.py --precision``).
    ``impl``: how each block's chunks are walked: ``"xla"`` (a ``lax.scan``, the default: the one measured) or
    ``"pallas"`` (:mod:`gated_delta_scan`'s kernels, the state on chip; their float32 products are tf32x3 on a GPU;
    not yet timed: ``experiments/bench_delta.py --impl pallas``). ``interpret``: Pallas' interpret mode (None: unless
    the default device is a GPU; pass False to build for a GPU from elsewhere). ``scan_blocks``: the kernels' tiles
    (:class:`gated_delta_scan.ScanBlocks`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(map(repr, IMPLS))}")
    b, s, hk, dk, hv, dv = check_inputs(q, k, v, g, beta, chunk, block)
    scan = None
    if impl == "pallas":
        interpret = jax.devices()[0].platform != "gpu" if interpret is None else bool(interpret)
        gated_delta_scan.check_shapes(chunk, dk, dv)
        if not interpret and compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype) == jnp.float64:
            raise ValueError("impl='pallas' on a GPU computes in float32; float64 inputs need impl='xla' (or "
                             "interpret=True)")
        scan = Scan(scan_blocks or gated_delta_scan.ScanBlocks(), interpret)
    n = hv // hk
    _, m, pad = blocking(s, chunk, block)
    doc = document_index(segment_ids, b, s)

    def padded(x, mode="constant"):  # a copy only where the sequence is not a multiple of the blocks
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode) if pad else x

    g, beta = (padded(x.reshape(b, s, hk, n)) for x in (g, beta))
    doc = padded(doc, mode="edge")  # padding continues the last document
    last = doc.reshape(b, -1, chunk)[:, :, -1]
    prev = jnp.concatenate([doc[:, :1], last[:, :-1]], axis=1)  # the document each chunk's incoming state is of
    o = _chunked(padded(q), padded(k), padded(v.reshape(b, s, hk, n, dv)), g, beta, doc, prev, m, chunk,
                 use_qk_l2norm, precision == "bf16", scan)
    return o.reshape(b, s + pad, hv, dv)[:, :s] if pad else o.reshape(b, s, hv, dv)


def blocking(seq: int, chunk: int, block: int) -> tuple[int, int, int]:
    """``(blocks, chunks per block, padding tokens)``: ``ceil(chunks / block)`` blocks of equal size covering the
    sequence's chunks, so the padding stays under one chunk per block (plus the last chunk's)."""
    chunks = -(-seq // chunk)
    nb = -(-chunks // block)
    m = -(-chunks // nb)
    return nb, m, nb * m * chunk - seq


def check_inputs(q, k, v, g, beta, chunk=CHUNK, block=BLOCK):
    """The shapes' contract; raises ``ValueError`` naming the mismatch. Returns ``(B, S, Hk, dk, Hv, dv)``."""
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [batch, seq, key heads, dk]")
    b, s, hk, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (b, s) or v.shape[2] % hk:
        raise ValueError(f"v {v.shape} must be [batch, seq, value heads, dv] with value heads a multiple of the "
                         f"{hk} key heads (q, k {q.shape})")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g {g.shape} and beta {beta.shape} must both be [batch, seq, value heads] = {v.shape[:3]}")
    for name, x in (("chunk", chunk), ("block", block)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} ({x!r}) must be a positive int (tokens per chunk, chunks per block)")
    return b, s, hk, dk, v.shape[2], v.shape[3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _chunked(q, k, v, g, beta, doc, prev, m, c, use_qk_l2norm, low, scan):
    """Token-major core (:func:`_forward`'s layouts): ``o [B, T, Hk, n, dv]`` in ``q``'s dtype."""
    return _forward((q, k, v, g, beta, doc, prev), m, c, use_qk_l2norm, keep_block_states=False, low=low,
                    scan=scan)[0]


def _chunked_fwd(q, k, v, g, beta, doc, prev, m, c, use_qk_l2norm, low, scan):
    inputs = (q, k, v, g, beta, doc, prev)
    o, states = _forward(inputs, m, c, use_qk_l2norm, keep_block_states=True, low=low, scan=scan)
    states = checkpoint_name(states, BLOCK_STATES)  # what a remat policy may keep while the inputs are recomputed
    return o, (inputs, states)  # the inputs themselves, and each block's incoming state [NB, B, Hk, n, dk, dv]


# ---------------------------------------------------------------------------------------------------
# Backward: blocks in reverse; in each, the intra parts and chunk states again, then its chunks in reverse
# ---------------------------------------------------------------------------------------------------


def _walk_back(state, parts, do_block, d_state, low: bool, scan: Scan | None):
    """A block's chunks in reverse: ``(gradient of the block's incoming state, of its parts)`` from the incoming
    state, the parts, ``do [M, B, Hk, n, C, dv]`` and the gradient of the state leaving the block. Each chunk's
    incoming state is recomputed first (one more forward walk); then a reverse ``lax.scan`` of each step's
    ``jax.vjp``, or with ``scan`` the Pallas backward."""
    step = functools.partial(_step, low=low)
    if scan is None:
        _, chunk_states = lax.scan(lambda st, p: (step(st, p)[0], st), state, parts)  # each chunk's incoming

        def chunk_back(d_out, xs):  # d_out: the gradient of the state leaving this chunk
            st, p, do_chunk = xs
            return jax.vjp(step, st, p)[1]((d_out, do_chunk))  # (gradient of the incoming state, of the parts)

        return lax.scan(chunk_back, d_state, (chunk_states, parts, do_block), reverse=True)
    flat = tuple(_heads(x, 1) for x in parts)
    _, _, chunk_states = gated_delta_scan.scan_forward(_heads(state, 0), flat, low=low, keep_states=True,
                                                       output=False, blocks=scan.blocks, interpret=scan.interpret)
    d_in, d_flat = gated_delta_scan.scan_backward(chunk_states, flat, _heads(do_block, 1), _heads(d_state, 0),
                                                  low=low, blocks=scan.blocks, interpret=scan.interpret)
    return d_in.reshape(state.shape), tuple(d.reshape(p.shape) for d, p in zip(d_flat, parts))


def _chunked_bwd(m, c, use_qk_l2norm, low, scan, res, do):
    inputs, states = res
    doc, prev, length = inputs[5], inputs[6], m * c

    def block_back(carry, xs):
        (d_state, grads), (i, state) = carry, xs
        ids = _block(doc, i, length), _block(prev, i, m)
        parts, parts_vjp = jax.vjp(lambda *x: _block_parts(*x, *ids, m, c, use_qk_l2norm, low),
                                   *_blocks(inputs[:5], i, length))
        do_block = _blocks((do,), i, length)[0]
        do_block = do_block.reshape(do.shape[0], m, c, *do.shape[2:]).transpose(1, 0, 3, 4, 2, 5)
        d_state, d_parts = _walk_back(state, parts, do_block.astype(state.dtype), d_state, low, scan)
        d_block = parts_vjp(d_parts)
        grads = tuple(lax.dynamic_update_slice_in_dim(x, d, i * length, axis=1) for x, d in zip(grads, d_block))
        return (d_state, grads), None

    init = (jnp.zeros_like(states[0]), tuple(jnp.zeros_like(x) for x in inputs[:5]))
    (_, grads), _ = lax.scan(block_back, init, (jnp.arange(states.shape[0]), states), reverse=True)
    return (*grads, None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
