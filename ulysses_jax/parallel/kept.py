"""Attention whose forward runs once under rematerialisation: its output and log-sum-exp are kept for the backward.

Under ``--remat`` the backward re-runs each layer's forward, attention's kernel included (about a fifth of
attention's time at long context: forward, forward again, backward). ``kept_attention`` is the local attention of
``ulysses_attention`` as a ``custom_vjp`` whose forward returns the output ``o`` and the log-sum-exp ``lse`` of the
kernel, named ``ATTN_OUT`` / ``ATTN_LSE`` (``jax.ad_checkpoint.checkpoint_name``); the remat policies of
``ModelConfig.attn_keep`` save those names (on the device with ``--remat full``, in pinned host memory beside the
layer input with ``--remat offload``). The backward then runs only the kernel's backward from ``(q, k, v, o, lse)``;
``q``, ``k``, ``v`` themselves are recomputed (norm, projections, RoPE and the exchange: the cheap parts).

Kernels: our Pallas kernel, the blockwise kernel and the XLA reference through their pair forms (``ring.ring_kernel``:
forward with the log-sum-exp, backward from it), and cuDNN through its forward and backward primitives
(``kernels/cudnn_packed.py``; packed rows too). Attention sinks (``kernels/sinks.py``) go into the kernel's forward
(cuDNN has none: ``resolve_impl`` refuses it before), the backward adds their gradient from ``lse``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ulysses_jax.kernels import cudnn_packed
from ulysses_jax.kernels.sinks import sink_grad, vary_like
from ulysses_jax.parallel.ring import ring_kernel

ATTN_OUT = "attn_out"  # checkpoint_name of each layer's attention output (kept for the backward)
ATTN_LSE = "attn_lse"  # ... and of its log-sum-exp
_F32 = jnp.float32


def keep_output(o: jax.Array) -> jax.Array:
    """``o [..., heads, dim]`` named ``ATTN_OUT`` as ``[..., heads * dim]``: the token mixer's output a remat policy of
    ``--attn-keep`` saves. Flat, so that a hybrid's two mixers (attention, the delta-net: ``parallel/ulysses_delta``)
    give one residual shape when their widths agree (16 x 256 and 32 x 128 in Qwen3.5 and Qwen3-Next), and the layer
    switch keeps one slot per layer for both rather than one each."""
    return checkpoint_name(o.reshape(*o.shape[:-2], -1), ATTN_OUT).reshape(o.shape)


@dataclasses.dataclass(frozen=True)
class _Spec:
    impl: str  # resolved: xla, blockwise, pallas, cudnn
    platform: str
    causal: bool
    scale: float
    window: int | None
    max_documents: int | None

    @property
    def window_kw(self) -> dict:
        return {} if self.window is None else {"window": self.window}


def kept_attention(q, k, v, segment_ids=None, *, causal: bool, scale: float, impl: str, platform: str,
                   window: int | None = None, max_documents: int | None = None, sinks=None) -> jax.Array:
    """``attention(q, k, v, ...)`` (``[B, S, H, D]``, ``impl`` resolved) with the output and log-sum-exp named for
    the remat policy (module doc); ``sinks``: ``[H]`` attention-sink logits, or None."""
    spec = _Spec(impl, platform, causal, float(scale), window, max_documents)
    sinks = None if sinks is None else vary_like(sinks, q)
    if impl != "cudnn" or segment_ids is None:
        return _kept(spec, q, k, v, segment_ids, sinks)
    return cudnn_packed.around_packed(lambda q, k, v: _kept(spec, q, k, v, segment_ids, sinks), q, k, v,
                                      segment_ids, max_documents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kept(spec: _Spec, q, k, v, seg, sinks):
    return _kept_fwd(spec, q, k, v, seg, sinks)[0]


def _forward(spec: _Spec, q, k, v, seg, sinks):
    if spec.impl == "cudnn":
        return cudnn_packed.cudnn_forward(q, k, v, seg, causal=spec.causal, scale=spec.scale, window=spec.window,
                                          max_segments=spec.max_documents, platform=spec.platform)
    pos = jnp.arange(q.shape[1], dtype=jnp.int32)  # token indices: only the xla kernel reads them
    sink_kw = {} if sinks is None else {"sinks": sinks}
    o, lse = ring_kernel(spec.impl, spec.platform, float32=False).forward(
        q, k, v, pos, pos, seg, seg, causal=spec.causal, scale=spec.scale, **spec.window_kw, **sink_kw)
    return o.astype(q.dtype), lse


def _kept_fwd(spec: _Spec, q, k, v, seg, sinks):
    o, lse = _forward(spec, q, k, v, seg, sinks)
    o, lse = keep_output(o), checkpoint_name(lse, ATTN_LSE)
    return o, (q, k, v, seg, sinks, o, lse)


def _kept_bwd(spec: _Spec, res, do):
    q, k, v, seg, sinks, o, lse = res
    dsinks = None
    if spec.impl == "cudnn":
        grads = cudnn_packed.cudnn_backward(q, k, v, seg, o, lse, do, causal=spec.causal, scale=spec.scale,
                                            window=spec.window, max_segments=spec.max_documents,
                                            platform=spec.platform)
    else:
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)
        delta = jnp.einsum("bshd,bshd->bhs", o.astype(_F32), do.astype(_F32))
        grads = ring_kernel(spec.impl, spec.platform, float32=False).backward(
            q, k, v, pos, pos, seg, seg, do, lse, delta, causal=spec.causal, scale=spec.scale, **spec.window_kw)
        dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    dq, dk, dv = (g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    return dq, dk, dv, None, dsinks


_kept.defvjp(_kept_fwd, _kept_bwd)
