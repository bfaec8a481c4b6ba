"""The short causal depthwise convolution before the gated delta rule (Qwen3-Next / Qwen3.5's q, k, v channels).

Kernel ``K`` (4 in those models), one filter per channel, SiLU after, and (with segment ids) reset at every document
start, as ``gated_delta`` resets its state. Its own backward (``custom_vjp``) keeps only the input and holds no
float32 ``[B, S, C]`` array across a fusion (:func:`_conv`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ulysses_jax.kernels.gated_delta import compute_dtype, document_index

def causal_conv1d(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None, *,
                  activation: str | None = "silu") -> jax.Array:
    """Depthwise causal convolution ``x [B, S, C]`` by ``w [C, K]``, then SiLU (``activation=None``: none).

    ``out[t, c] = sum_i w[c, i] * x[t - (K - 1) + i, c]``: ``w[:, -1]`` weighs the token itself, as transformers'
    ``nn.Conv1d`` weight ``[C, 1, K]`` squeezed to ``[C, K]``. Taps before the sequence, or (with ``segment_ids``)
    in an earlier document, read zero: a document never sees the previous one. float32 (float64) inside, output in
    ``x``'s dtype."""
    b, s, c = x.shape
    if w.ndim != 2 or w.shape[0] != c:
        raise ValueError(f"w {w.shape} must be [channels, kernel size] with the {c} channels of x {x.shape}")
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r}: 'silu' (the Qwen3-Next layer's) or None")
    doc = document_index(segment_ids, b, s) if segment_ids is not None else None
    return _conv(x, w, doc, activation)


def _shift(a, lag: int, doc, ahead: bool = False):
    """``a[t - lag]`` at each token ``t`` (``[B, S, C]``), zero before the sequence and across a document start; with
    ``ahead``, its transpose: ``a[t + lag]`` where that token is in ``t``'s document, else zero."""
    s = a.shape[1]
    side = (0, lag) if ahead else (lag, 0)
    out = jnp.pad(a[:, lag:] if ahead else a[:, : s - lag], ((0, 0), side, (0, 0)))
    if doc is None:
        return out
    return jnp.where(jnp.pad(doc[:, lag:] == doc[:, : s - lag], ((0, 0), side))[..., None], out, 0)


def _taps(x, w, doc):
    """The convolution before its activation, in the compute dtype (float32 / float64). Each tap shifts ``x`` in its
    own dtype and converts after: converted first, XLA kept one float32 copy of the whole input for all the taps."""
    f = compute_dtype(x.dtype, w.dtype)
    wf, k = w.astype(f), w.shape[1]
    out = x.astype(f) * wf[:, k - 1]
    for lag in range(1, min(k, x.shape[1])):  # the tap reading token t - lag
        out = out + _shift(x, lag, doc).astype(f) * wf[:, k - 1 - lag]
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv(x, w, doc, activation):
    """:func:`causal_conv1d`'s body. Its backward keeps only ``x`` (in its own dtype), runs the taps again, and holds
    the pre-activation's gradient in ``x``'s dtype: no float32 ``[B, S, C]`` array outlives a fusion. At Qwen3.5-9B's
    longest contexts under sp = 8 (one value head per group, 5.7M tokens) those float32 arrays were 8.2 GiB each, two
    at the backward's peak (the compiled H100 plan); at 1M tokens without groups the forward's were 4 GiB each."""
    pre = _taps(x, w, doc)
    return (jax.nn.silu(pre) if activation == "silu" else pre).astype(x.dtype)


def _conv_fwd(x, w, doc, activation):
    return _conv(x, w, doc, activation), (x, w, doc)


def _conv_bwd(activation, res, g):
    x, w, doc = res
    f = compute_dtype(x.dtype, w.dtype)
    d = g.astype(f)
    if activation == "silu":  # silu'(p) = sigmoid(p) (1 + p (1 - sigmoid(p)))
        pre = _taps(x, w, doc)
        sig = jax.nn.sigmoid(pre)
        d = d * sig * (1 + pre * (1 - sig))
    # rounded to x's dtype: the one [B, S, C] array the backward keeps; the barrier makes the rounding happen where
    # d is made (left free, XLA kept d in float32 and rounded it inside each consumer: a float32 [B, S, C] of 12 GiB
    # at Qwen3.5-9B's 8M tokens under sp = 8)
    d = jax.lax.optimization_barrier(d.astype(x.dtype))
    df, wf, k, s = d.astype(f), w.astype(f), w.shape[1], x.shape[1]
    dx, dw = df * wf[:, k - 1], [jnp.sum(df * x.astype(f), axis=(0, 1))]
    for lag in range(1, k):  # tap k - 1 - lag read token t - lag
        if lag < s:
            dx = dx + _shift(d, lag, doc, ahead=True).astype(f) * wf[:, k - 1 - lag]
            dw.append(jnp.sum(df * _shift(x, lag, doc).astype(f), axis=(0, 1)))
        else:  # fewer tokens than taps: the tap read nothing
            dw.append(jnp.zeros(w.shape[:1], f))
    return dx.astype(x.dtype), jnp.stack(dw[::-1], axis=1).astype(w.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)
