"""Sliding-window attention: the window's contract and the tile arithmetic every kernel shares.

A window of ``W`` tokens: query ``i`` sees key ``j`` when ``i - W < j <= i`` (causal), and, with segment ids, only
inside its own document. ``W = None`` is full causal attention. Positions are token indices of the sequence a kernel
holds, except for one generalisation the ring needs (``parallel/ring.py``): a (query block, key block) pair whose
query positions are the key positions shifted by a static ``offset`` (query row ``i`` sits at position ``i + offset``
of the key block's frame). ``offset = 0`` is the usual aligned case.

Tile skipping. A query tile covering rows ``[i0, i1]`` (positions ``i0 + offset .. i1 + offset``) can see keys
``[i0 + offset - W + 1, i1 + offset]``: the KV tiles ``[lo, hi)`` of :func:`kv_tiles`. A KV tile covering
``[j0, j1]`` is seen by query rows ``[j0 - offset, j1 + W - 1 - offset]``: the query tiles of :func:`q_tiles`.
With square tiles of ``b`` tokens, a sequence of ``n`` tiles and no documents, query tile ``i`` visits
``min(i, ceil((W - 1) / b)) + 1`` KV tiles (:func:`window_tile_count` sums them): ``O(S * W)`` work, not ``O(S^2)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

SKIP, FULL, MASKED = 0, 1, 2  # a block pair: no allowed entry, every entry allowed, some masked (see block_kind)


def check_window(window, *, causal: bool = True) -> int | None:
    """``window`` as an int (``None`` stays ``None``); raises ``ValueError`` naming the value and the fix."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window ({window!r}) must be a positive number of tokens (query i sees keys i - window < j "
                         f"<= i); pass window=None for full attention")
    if not causal:
        raise ValueError(f"window ({window}) is a causal sliding window; pass causal=True with it (or window=None)")
    return int(window)


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def kv_tiles(q_tile, *, block_q: int, block_k: int, seq_len: int, causal: bool, window: int | None = None,
             offset: int = 0):
    """KV tiles ``[lo, hi)`` that query tile ``q_tile`` (traced or int) can see; ``lo == hi`` for none.

    Causal: tiles after the tile's last row are skipped; window: tiles before its first row's window are skipped;
    tiles made only of padding (at or past ``seq_len``) are skipped. int32 throughout (Triton loop bounds)."""
    num = _i32(-(-seq_len // block_k))
    first = _i32(q_tile) * block_q + offset  # position of the tile's first query row
    hi = jnp.minimum(lax.div(first + block_q - 1, _i32(block_k)) + 1, num) if causal else num
    lo = _i32(0) if window is None else lax.div(jnp.maximum(first - (window - 1), 0), _i32(block_k))
    return jnp.minimum(lo, hi), hi


def q_tiles(kv_tile, *, block_q: int, block_k: int, seq_len: int, causal: bool, window: int | None = None,
            offset: int = 0):
    """Query tiles ``[lo, hi)`` that can see KV tile ``kv_tile``; the dK/dV passes visit only those.

    Causal: query tiles entirely before the KV tile are skipped; window: those entirely past its last key's window.
    Query tiles made only of padding are skipped (their dO is 0); a KV tile of padding is seen by none."""
    k0 = _i32(kv_tile) * block_k
    lo = lax.div(jnp.maximum(k0 - offset, 0), _i32(block_q)) if causal else _i32(0)
    hi = jnp.where(k0 < seq_len, _i32(-(-seq_len // block_q)), lo)
    if window is not None:  # last query row that sees this tile: j1 + W - 1 - offset
        last = k0 + block_k + window - 2 - offset
        hi = jnp.minimum(hi, lax.div(jnp.maximum(last + block_q, 0), _i32(block_q)))
    return lo, jnp.maximum(hi, lo)


def allowed(q_pos, k_pos, *, causal: bool, window: int | None):
    """Boolean ``q_pos[:, None]`` x ``k_pos[None, :]`` of allowed pairs by position, or ``None`` if all are."""
    mask = None
    if causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        near = (q_pos[:, None] - k_pos[None, :]) < window
        mask = near if mask is None else jnp.logical_and(mask, near)
    return mask


def window_tile_count(num_tiles: int, block: int, window: int | None) -> int:
    """Tiles a causal (windowed) pass visits over ``num_tiles`` square tiles of ``block`` tokens, no documents."""
    reach = num_tiles if window is None else -(-(window - 1) // block)
    return sum(min(i, reach) + 1 for i in range(num_tiles))


def block_kind(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, window: int | None = None) -> int:
    """``SKIP`` / ``FULL`` / ``MASKED`` for a (query run, key run) pair of contiguous global positions."""
    if not causal:
        return FULL
    q_lo, q_hi, k_lo, k_hi = int(q_pos.min()), int(q_pos.max()), int(k_pos.min()), int(k_pos.max())
    if k_lo > q_hi:
        return SKIP  # every key in every query's future
    if window is not None and k_hi <= q_lo - window:
        return SKIP  # every key behind every query's window
    if k_hi <= q_lo and (window is None or k_lo > q_hi - window):
        return FULL
    return MASKED
