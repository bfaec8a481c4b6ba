"""Packed rows (documents marked by segment ids) on cuDNN's fused attention.

cuDNN's flash attention takes packed documents as ragged offsets, not as segment ids: per row, the length of each
document (``seqlen: [B, M]``) and where it starts (``offsets: [B, M + 1]``), ``M`` a static bound on documents per
row, unused entries ``-1`` (jax's ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``; the packed
layout needs a Hopper GPU or later). ``segments_to_ragged`` turns the segment ids the packer writes into those,
inside the program.

The segment-id convention it reads (``ulysses_jax/data/pipeline.py``): each document's tokens are contiguous, with
an id different from its neighbours'; id ``0`` marks padding. The id values themselves are not used, only where
they change: a document starts where the id differs from the token before (or at the row's start), unless that
token is padding. Padding tokens belong to no document: cuDNN writes nothing meaningful there, so the output is
zeroed at padding (their cotangent is zero under a loss that ignores them, so their gradients are zero too).

A row with more documents than ``max_segments`` cannot be expressed; ``ragged_overflow`` is the in-program flag for
it, and the caller refuses such a batch (a wrong mask is never silent).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B, S]`` bool: the first token of each document (padding, id 0, starts none)."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
    first = jnp.arange(segment_ids.shape[1]) == 0
    return (segment_ids != 0) & (first | (segment_ids != prev))


def segments_to_ragged(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(seqlen [B, M] int32, offsets [B, M + 1] int32, count [B] int32)`` for segment ids ``[B, S]``.

    ``seqlen[b, j]`` / ``offsets[b, j]``: the length and first position of row ``b``'s ``j``-th document,
    ``-1`` past the row's ``count[b]`` documents (and always in ``offsets``' last entry while ``count < M + 1``).
    Documents past ``M`` are dropped here; ``count > M`` says so (``ragged_overflow``).
    """
    b, s = segment_ids.shape
    m = int(max_segments)
    starts = document_starts(segment_ids)
    index = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # document of each token; -1 before the first
    count = index[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    # scatter each start's position into its document's slot; non-starts go to slot m + 1 (dropped)
    slot = jnp.where(starts, index, m + 1)
    offsets = jnp.full((b, m + 1), -1, jnp.int32).at[rows, slot].set(pos, mode="drop")
    offsets = jnp.where(jnp.arange(m + 1) < m, offsets, -1)  # the (M+1)-th entry stays -1
    real = (segment_ids != 0) & (index >= 0)
    lengths = jnp.zeros((b, m), jnp.int32).at[rows, jnp.where(real, index, m)].add(1, mode="drop")
    seqlen = jnp.where(jnp.arange(m) < count[:, None], lengths, -1)
    return seqlen, offsets, count


def ragged_overflow(segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """Scalar bool: some row has more than ``max_segments`` documents."""
    return jnp.any(jnp.sum(document_starts(segment_ids), axis=1) > max_segments)


def ragged_mask(seqlen: jax.Array, offsets: jax.Array, seq_len: int, *, causal: bool,
                window: int | None = None) -> jax.Array:
    """The ``[B, 1, 1, S, S]`` boolean mask the ragged description stands for (the reference's layout): query ``i``
    and key ``j`` see each other when both lie in the same listed document (and ``j <= i`` when causal, ``i - j <
    window`` with a window). Used to test ``segments_to_ragged`` against the segment-id mask."""
    pos = jnp.arange(seq_len)
    start = offsets[:, :-1, None]  # [B, M, 1]
    inside = (seqlen[:, :, None] > 0) & (pos >= start) & (pos < start + seqlen[:, :, None])  # [B, M, S]
    same = jnp.einsum("bmq,bmk->bqk", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
    if causal:
        same = same & (pos[:, None] >= pos[None, :])
    if window is not None:
        same = same & (pos[:, None] - pos[None, :] < window)
    return same[:, None, None]


MAX_DOCUMENTS = 16  # the default bound M on documents per row; cuDNN's softmax statistics are [B * M, H, S] float32


def cudnn_packed_attention(q, k, v, segment_ids, *, causal: bool, scale: float, max_segments: int = MAX_DOCUMENTS,
                           window: int | None = None) -> jax.Array:
    """cuDNN flash attention over packed rows, ``[B, S, H, D]`` layout (GQA: fewer K/V heads). GPU (Hopper+) only.

    Q, K and V are zeroed at padding before the call, so the gradients there are exactly zero: measured on an H100
    (cuDNN 9.19, jax 0.11.2, 2026-11-26), cuDNN's packed backward leaves dK / dV at tokens outside every document
    unwritten with GQA (relative errors 0.4-0.8 against the reference until masked). A row with more than
    ``max_segments`` documents makes the whole output NaN (the training loop stops on a non-finite loss; the data
    path refuses such a batch first with the count and the flag to raise).
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    seqlen, offsets, count = segments_to_ragged(segment_ids, max_segments)
    real = (segment_ids != 0)[:, :, None, None]
    q, k, v = (jnp.where(real, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    mask_type = cudnn_fa.MaskType.PADDING_CAUSAL if causal else cudnn_fa.MaskType.PADDING
    out = cudnn_fa.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                         kv_offsets=offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH",
                                         sliding_window_length=window)
    out = jnp.where(real, out, jnp.zeros((), out.dtype))
    return jnp.where(jnp.any(count > max_segments), jnp.full((), jnp.nan, out.dtype), out)
