"""The ring's plain ``jnp`` local kernel (``ring.XLA_KERNEL``): one (query block, KV block) pair with its log-sum-exp.

``xla_forward`` returns the pair's normalised float32 output and natural-log log-sum-exp; ``xla_backward`` the pair's
float32 gradients given the *global* log-sum-exp and ``delta = rowsum(dO * O)``. Masks come from the global positions
given (causal, the sliding window of ``kernels/window.py``) and the segment ids; the contract is ``parallel/ring.py``'s.
``sinks`` (``kernels/sinks.py``) join the forward's softmax; the backward needs none (the global ``lse`` has them).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ulysses_jax.kernels.sinks import with_sinks

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _mask(q_pos, k_pos, q_seg, k_seg, causal: bool, window=None):
    """Boolean mask broadcasting to ``[b, Hkv, G, sq, sk]``, or ``None`` for no mask."""
    mask = (q_pos[:, None] >= k_pos[None, :])[None, None, None] if causal else None
    if window is not None:
        near = (q_pos[:, None] - k_pos[None, :] < window)[None, None, None]
        mask = near if mask is None else mask & near
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    return mask


def _logits(q, k, q_pos, k_pos, q_seg, k_seg, causal, scale, window=None):
    """``q [b, sq, H, D]``, ``k [b, sk, Hkv, D]`` -> masked float32 logits ``[b, Hkv, G, sq, sk]`` and q grouped."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    q_bqkgd = q.reshape(b, sq, hkv, h // hkv, d).astype(_F32)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_bqkgd, k.astype(_F32), precision=_HIGHEST) * scale
    mask = _mask(q_pos, k_pos, q_seg, k_seg, causal, window)
    return (s if mask is None else jnp.where(mask, s, -jnp.inf)), q_bqkgd


def xla_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool, scale: float, window=None, offset: int = 0,
                sinks=None):
    """-> ``o [b, sq, H, D]`` float32 (0 for rows that see no key), ``lse [b, H, sq]`` float32 (-inf there; with
    ``sinks [H]``, the sink's logit in both). Masks by the positions given (``offset`` is what they imply; not read)."""
    b, sq, h, d = q.shape
    s, _ = _logits(q, k, q_pos, k_pos, q_seg, k_seg, causal, scale, window)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p / jnp.where(den > 0, den, 1.0), v.astype(_F32), precision=_HIGHEST)
    lse = jnp.where(den > 0, m + jnp.log(den), -jnp.inf)  # [b, Hkv, G, sq, 1]
    return with_sinks(o.reshape(b, sq, h, d), lse.reshape(b, h, sq), sinks)


def xla_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, do, lse, delta, *, causal: bool, scale: float, window=None,
                 offset: int = 0):
    """Gradients of one pair given the global ``lse`` and ``delta [b, H, sq]``: float32 dq, dk, dv."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    s, q_bqkgd = _logits(q, k, q_pos, k_pos, q_seg, k_seg, causal, scale, window)
    lse = lse.reshape(b, hkv, h // hkv, sq, 1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0))  # masked entries: exp(-inf) = 0
    do_bqkgd = do.reshape(b, sq, hkv, h // hkv, d).astype(_F32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do_bqkgd, v.astype(_F32), precision=_HIGHEST)
    ds = p * (dp - delta.reshape(b, hkv, h // hkv, sq, 1))
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(_F32), precision=_HIGHEST) * scale
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q_bqkgd, precision=_HIGHEST) * scale
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, do_bqkgd, precision=_HIGHEST)
    return dq.reshape(b, sq, h, d), dk, dv
