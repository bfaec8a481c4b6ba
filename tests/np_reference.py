"""An independent float64 NumPy reference for attention: forward and hand-written backward."""

import jax
import jax.numpy as jnp
import numpy as np


def attention_f64(q, k, v, dout=None, *, causal=True, segment_ids=None, scale=None, window=None):
    """q [B,S,H,D], k/v [B,S,Hkv,D] -> out [B,S,H,D] (and dq, dk, dv for cotangent ``dout``), in float64.
    ``window=W``: query i sees keys i - W < j <= i."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kh, vh = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads kv head i // g
    mask = np.ones((b, 1, s, s), dtype=bool)
    if causal:
        mask &= np.tril(np.ones((s, s), dtype=bool))[None, None]
    if window is not None:
        mask &= (np.arange(s)[:, None] - np.arange(s)[None, :] < window)[None, None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask &= (seg[:, :, None] == seg[:, None, :])[:, None]
    logits = np.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, vh)
    if dout is None:
        return out
    do = np.asarray(dout, dtype=np.float64)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vh)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
    dkh = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dvh = np.einsum("bhqk,bqhd->bkhd", p, do)
    dk = dkh.reshape(b, s, -1, g, d).sum(axis=3)
    dv = dvh.reshape(b, s, -1, g, d).sum(axis=3)
    return out, (dq, dk, dv)


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref|, in float64."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# Tolerances on rel_err (max-abs error over max-abs reference).
# float32: the XLA path computes in float32 at HIGHEST precision; errors measured ~1e-6.
# bfloat16: inputs are rounded to bf16 before the float64 reference sees them, so the error is
# the output/gradient rounding (bf16 has 8 bits of mantissa: 2^-8 = 3.9e-3) plus bf16 sums of
# gradients of replicated KV heads.
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def random_inputs(seed, b, s, h, hkv, d, dtype, *, n_docs=3, shard=None):
    """Normal q, k, v and cotangent, and segment ids of ``n_docs`` random-length documents.

    With ``shard`` given, no document boundary falls on a multiple of ``shard`` (so documents
    cross the boundaries between sequence shards of that length).
    """
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, s, h, d), dtype)
    k = jax.random.normal(ks[1], (b, s, hkv, d), dtype)
    v = jax.random.normal(ks[2], (b, s, hkv, d), dtype)
    do = jax.random.normal(ks[3], (b, s, h, d), dtype)
    cuts = np.asarray(jax.random.randint(ks[4], (b, n_docs - 1), 1, s))
    if shard is not None:
        cuts = np.where(cuts % shard == 0, cuts + 1, cuts) % s
    seg = (np.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    return q, k, v, do, jnp.asarray(seg)
