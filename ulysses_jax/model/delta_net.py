"""The gated delta-net sublayer (the "linear" layers of Qwen3.5 and Qwen3-Next): projections, the Ulysses exchange,
the gated RMSNorm and the output projection.

Per layer, on the normed input ``x [B, S, D]`` (sequence-split over ``sp``, like every activation)::

    q, k = x W_q, x W_k  [B, S, Hk, dk]    v, z = x W_v, x W_z  [B, S, Hv, dv]    b, a = x W_b, x W_a  [B, S, Hv]
    o = ulysses_gated_delta(q, k, v, a, b, ...)        the exchange, conv, gates and rule on whole sequences
    y = rms_norm(o) * w_norm * silu(z)                 per token and head (Qwen3NextRMSNormGated: over dv, plain w)
    out = y W_o                                        [B, S, D]

The parameters are stored per head (``wq_DJQ [D, Hk, dk]``, ``wv_DUW [D, Hv, dv]``, ..., the convolution's filters
``conv_v_UWC [Hv, dv, K]``, ``a_log_U``, ``dt_bias_U [Hv]``, ``wo_UWD [Hv, dv, D]``), so that a head's weights are one
slice of each: the exchange hands each device whole heads, and each takes its own heads' filters and gates
(``parallel/ulysses_delta.py``). Like every weight they are FSDP-split at rest over their ``embed`` dimension (the
filters, gates and norm, which have none, whole) and gathered where they are used.

``z`` never crosses the exchange: the gated norm needs, for one token and one head, that head's output and ``z`` of
the same token and head, both on the sequence-split side once the output has come back. Shapes follow the model's
letters (``model/transformer.py``) with ``J`` key heads, ``U`` value heads, ``Q`` / ``W`` their head dims and ``C``
the filter length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ulysses_jax.model import lora
from ulysses_jax.model.layers import ParamMaker, use
from ulysses_jax.parallel.mesh import RING, SP
from ulysses_jax.parallel.sharding import constrain
from ulysses_jax.parallel.ulysses_delta import plan_delta_heads, ulysses_gated_delta


@functools.partial(jax.checkpoint, static_argnums=(3,))
def gated_rms_norm(o, z, w, eps: float):
    """``rms_norm(o) * w * silu(z)`` over the last axis (a value head's ``dv``), float32 inside, ``o``'s dtype out.
    Rematerialised: its backward recomputes the float32 intermediates from ``o`` and ``z`` rather than keeping them
    (each ``[B, S/sp, Hv, dv]`` float32, twice the size of ``o``)."""
    o32 = o.astype(jnp.float32)
    y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def check_mesh(cfg, mesh) -> None:
    """A model with delta-net layers on ``mesh``: no ring, and heads that split over ``sp`` (one line otherwise)."""
    if mesh.shape.get(RING, 1) > 1:
        raise ValueError(f"{cfg.name} has gated delta-net ('linear') layers, which do not run with a ring "
                         f"(--mesh.ring {mesh.shape[RING]}): their recurrence would pass its state around the ring; "
                         f"use --mesh.ring 1 and sp for the sequence")
    plan_delta_heads(cfg.linear_num_key_heads, cfg.linear_num_value_heads, mesh.shape[SP])


def describe(cfg, mesh) -> str:
    """The start-up line of a hybrid: its layers of each kind and how the delta-net's heads split over ``sp``."""
    layout = plan_delta_heads(cfg.linear_num_key_heads, cfg.linear_num_value_heads, mesh.shape[SP])
    copies = f", key heads copied to {layout.sp // cfg.linear_num_key_heads} devices" if layout.copies_keys else ""
    return (f"{len(cfg.linear_layers)} gated delta-net layers (linear attention: {cfg.linear_num_key_heads} key / "
            f"{cfg.linear_num_value_heads} value heads of {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}, "
            f"{layout.kl} / {layout.vl} per device on sp={layout.sp}{copies}; the chunked delta rule in XLA ops) and "
            f"{len(cfg.attention_layers)} full-attention layers (output-gated, RoPE on {cfg.rotary_dim} of "
            f"{cfg.head_dim} dims); every layer stores both kinds' parameters")


def shapes(cfg) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    """Each delta-net parameter: ``(shape, logical axes, init)``."""
    d, hk, hv = cfg.hidden, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
    heads = ("embed", "linear_heads", "linear_dim")
    return {
        "wq_DJQ": ((d, hk, dk), heads, "normal"), "wk_DJQ": ((d, hk, dk), heads, "normal"),
        "wv_DUW": ((d, hv, dv), heads, "normal"), "wz_DUW": ((d, hv, dv), heads, "normal"),
        "wb_DU": ((d, hv), ("embed", "linear_heads"), "normal"),
        "wa_DU": ((d, hv), ("embed", "linear_heads"), "normal"),
        "conv_q_JQC": ((hk, dk, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "conv_k_JQC": ((hk, dk, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "conv_v_UWC": ((hv, dv, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "a_log_U": ((hv,), ("linear_heads",), "log_uniform"), "dt_bias_U": ((hv,), ("linear_heads",), "ones"),
        "norm_W": ((dv,), ("linear_dim",), "ones"),
        "wo_UWD": ((hv, dv, d), ("linear_heads", "linear_dim", "embed"), "normal"),
    }


class DeltaNet(nnx.Module):
    """The delta-net parameters of a layer (stacked over the layers like every block parameter; ``shapes``)."""

    def __init__(self, make: ParamMaker):
        self.cfg, self.mesh = make.cfg, make.mesh
        for name, (shape, names, init) in shapes(self.cfg).items():
            setattr(self, name, make(f"delta.{name.rsplit('_', 1)[0]}", shape, names, init=init))

    def __call__(self, x_BSD, segment_ids_BS, adapters=None, drop=None):
        """The sublayer's output ``[B, S, D]`` for the normed input (module doc). ``adapters``: LoRA's ``{target: (A,
        B)}`` (``lora.pairs(block, "delta")``), ``drop`` its dropout's ``(key, token ids)``."""
        cfg, mesh, dt = self.cfg, self.mesh, self.cfg.compute_jnp_dtype

        def proj(w, target=None, term=None):  # x W (+ LoRA's term: the target's, or a given share of a fused one's)
            out = jnp.einsum("bsd,d...->bs...", x_BSD, use(w, mesh, dt))
            out = out + (lora.low_rank(x_BSD, adapters, target, cfg.lora, drop) if term is None else term)
            return constrain(out, mesh, ("batch", "seq") + (None,) * (out.ndim - 2))

        qkv = lora.low_rank(x_BSD, adapters, "in_proj_qkv", cfg.lora, drop)  # one adapter over q, k, v (Qwen3.5's)
        terms = [0] * 3 if isinstance(qkv, int) else lora.split_fused(
            qkv, [w.get_value().shape[-2:] for w in (self.wq_DJQ, self.wk_DJQ, self.wv_DUW)])
        q, k, v = (proj(w, term=t) for w, t in zip((self.wq_DJQ, self.wk_DJQ, self.wv_DUW), terms))
        z, b, a = proj(self.wz_DUW, "in_proj_z"), proj(self.wb_DU, "in_proj_b"), proj(self.wa_DU, "in_proj_a")
        conv = [use(w, mesh, dt) for w in (self.conv_q_JQC, self.conv_k_JQC, self.conv_v_UWC)]
        o = ulysses_gated_delta(q, k, v, a, b, *conv, use(self.a_log_U, mesh, jnp.float32),
                                use(self.dt_bias_U, mesh, jnp.float32), mesh=mesh, axis_name=SP, ring_axis=RING,
                                segment_ids=segment_ids_BS)
        y = gated_rms_norm(constrain(o, mesh, ("batch", "seq", None, None)), z, use(self.norm_W, mesh, jnp.float32),
                           cfg.rms_eps)
        out = jnp.einsum("bsuw,uwd->bsd", y, use(self.wo_UWD, mesh, dt)) + lora.low_rank(y, adapters, "out_proj",
                                                                                          cfg.lora, drop)
        return constrain(out, mesh, ("batch", "seq", "embed"))
