"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a top-k router, dropless dispatch through grouped matmuls, and the
load-balancing statistics.

Shapes: ``E`` experts, ``k`` experts per token, ``F`` an expert's MLP width (``ModelConfig.expert_mlp_dim``), ``t``
the tokens of one device, ``P = t * k`` its token-expert pairs.

The sublayer runs inside ``shard_map`` on each device's own tokens (``[B/(data*fsdp), S/(ring*sp), D]``): routing,
sorting and the grouped matmuls never move a token between devices. The experts' weights are FSDP-sharded at rest
like every other parameter (their ``embed`` dimension over ``fsdp x ring x sp``) and all-gathered here, one layer at
a time; their gradient leaves as a reduce-scatter. At long context this moves less than expert parallelism, which
sends every token-expert pair to its expert's device and back (``docs/moe.md`` has the measured bytes).

Per device:
  1. router: ``logits = x @ W_r`` in float32, ``probs = softmax(logits)``, the top ``k`` of ``probs`` (renormalised to
     sum to 1 when ``router_renormalize``: Qwen3's ``norm_topk_prob``, always for Mixtral);
  2. dispatch: the ``P`` pairs sorted by expert (a stable sort), each pair's token gathered: ``[P, D]`` rows grouped by
     expert, ``group_sizes [E]`` tokens per expert; nothing dropped, whatever the load;
  3. experts: ``silu(x W_gate) * (x W_up) W_down`` as three grouped matmuls (``kernels/grouped_matmul.py``: a Pallas
     kernel on GPUs, ``jax.lax.ragged_dot`` elsewhere);
  4. combine: each pair's output back in token order, weighted by its routing weight, summed over the ``k``;
  5. with a shared expert (Qwen3-Next, Qwen3.5-MoE: ``shared_expert_dim``), every token's SwiGLU of that width times
     ``sigmoid(x w_shared_router)`` added.

With ``mlp_chunk`` the whole sublayer ``x + moe(norm(x))`` runs per chunk of the local tokens (``chunked.chunk_map``:
one chunk's ``[c*k, D]`` pairs at a time, recomputed in the backward).

Load balancing (transformers' ``load_balancing_loss_func``): over every sparse layer's tokens, ``f_e`` = share of the
top-k assignments that went to expert ``e`` and ``P_e`` = mean router probability of ``e``; the loss is
``E * sum_e f_e P_e``. Each layer returns ``(assignments [E], probability sums [E], tokens)`` over its valid tokens
(segment id != 0: padding is 0 in the data pipeline), summed over devices; ``aux_loss`` pools them over layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.attention import device_platform
from ulysses_jax.kernels.grouped_matmul import grouped_matmul
from ulysses_jax.kernels.grouped_matmul import resolve_impl as grouped_impl
from ulysses_jax.model.chunked import chunk_map
from ulysses_jax.model.config import ModelConfig, local_chunks
from ulysses_jax.model.layers import ParamMaker, mlp_activation, norm_scale, rms_norm
from ulysses_jax.parallel.mesh import DATA, FSDP, MESH_AXES, SEQ
from ulysses_jax.parallel.sharding import fsdp_axes, gather_param


class RouterStats(NamedTuple):
    """Routing statistics of the sparse layers, summed over the global batch (float32)."""

    assigned_LE: jax.Array  # top-k assignments per expert, per sparse layer
    prob_sum_LE: jax.Array  # router probabilities summed over tokens, per expert, per sparse layer
    tokens: jax.Array  # valid tokens (the same for every layer)


def aux_loss(stats: RouterStats) -> jax.Array:
    """transformers' load-balancing loss: ``E * sum_e f_e P_e``, both pooled over the sparse layers' tokens."""
    rows = jnp.maximum(stats.tokens * stats.assigned_LE.shape[0], 1.0)
    f_E = jnp.sum(stats.assigned_LE, axis=0) / rows
    p_E = jnp.sum(stats.prob_sum_LE, axis=0) / rows
    return stats.assigned_LE.shape[1] * jnp.sum(f_E * p_E)


def expert_load(stats: RouterStats) -> jax.Array:
    """Token-expert assignments per expert, summed over the sparse layers ``[E]`` (int32)."""
    return jnp.sum(stats.assigned_LE, axis=0).astype(jnp.int32)


def resolve_impl(impl: str, mesh: Mesh) -> str:
    """``auto``: the Pallas grouped matmul on GPUs (compile-only ones included), ``ragged_dot`` elsewhere (the
    kernel's own rule, for the mesh's devices)."""
    return grouped_impl(impl, device_platform(mesh))


def describe(cfg: ModelConfig, mesh: Mesh) -> str:
    """The start-up line of a mixture of experts: experts, layers, parameters, the grouped matmul, the aux loss."""
    from ulysses_jax.model.flops import active_param_count, param_count

    shared = f", a shared expert of {cfg.shared_expert_dim}" if cfg.shared_expert_dim else ""
    return (f"{cfg.num_experts}, top-{cfg.experts_per_token}{shared}, in {len(cfg.sparse_layers)} of "
            f"{cfg.num_layers} layers ({param_count(cfg) / 1e6:,.1f}M parameters, "
            f"{active_param_count(cfg) / 1e6:,.1f}M active per token); grouped matmul {cfg.moe_impl} -> "
            f"{resolve_impl(cfg.moe_impl, mesh)}; load-balancing "
            f"loss weight {cfg.router_aux_loss_coef:g} (--router-aux-loss-coef)")


def route(x_tD, w_DE, k: int, renormalize: bool, b_E=None):
    """``(weights [t, k] float32, experts [t, k] int32, probs [t, E] float32)`` of the top-``k`` router (``b_E``: its
    bias, gpt-oss). A softmax over the top-k logits (gpt-oss) is the renormalised top-k of the softmax."""
    logits_tE = jnp.einsum("td,de->te", x_tD, w_DE, preferred_element_type=jnp.float32)
    if b_E is not None:
        logits_tE = logits_tE + b_E.astype(jnp.float32)
    probs_tE = jax.nn.softmax(logits_tE, axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_tE, k)
    if renormalize:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return weights_tk, experts_tk, probs_tE


def clamped_swiglu(gate_up, limit: float, alpha: float):
    """gpt-oss's expert activation on the interleaved gate/up columns ``[..., 2F]``: ``(up + 1) * gate *
    sigmoid(alpha * gate)``, the gate clipped above at ``limit``, up to ``[-limit, limit]``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def experts_mlp(x_tD, ws: dict, *, k: int, renormalize: bool, impl: str, act=jax.nn.silu,
                platform: str | None = None, style: str = "swiglu", limit: float = 7.0, alpha: float = 1.702):
    """The routed experts' output ``[t, D]`` for tokens ``x [t, D]`` (steps 1-4 of the module doc), dropless.

    ``ws``: ``MoE.NAMES[style]``' weights: SwiGLU ``w_router_DE, w_gate_EDF, w_up_EDF, w_down_EFD``; gpt-oss adds the
    router's bias ``b_router_E``, fuses gate and up (interleaved columns) in ``w_gate_up_EDX`` with a bias
    ``b_gate_up_EX``, and biases the down projection (``b_down_ED``)."""
    t, d = x_tD.shape
    e = ws["w_router_DE"].shape[1]
    weights_tk, experts_tk, _ = route(x_tD, ws["w_router_DE"], k, renormalize, ws.get("b_router_E"))
    flat_P = experts_tk.reshape(-1)
    order_P = jnp.argsort(flat_P, stable=True)  # pairs grouped by expert, token order kept within a group
    group_sizes_E = jnp.bincount(flat_P, length=e).astype(jnp.int32)
    xs_PD = jnp.take(x_tD, order_P // k, axis=0)

    def gmm(a, w):
        return grouped_matmul(a, w, group_sizes_E, impl=impl, platform=platform)

    if style == "gpt_oss":
        expert_P = jnp.take(flat_P, order_P)  # each sorted pair's expert: its biases
        gate_up = gmm(xs_PD, ws["w_gate_up_EDX"]) + jnp.take(ws["b_gate_up_EX"], expert_P, axis=0)
        ys_PD = gmm(clamped_swiglu(gate_up, limit, alpha), ws["w_down_EFD"])
        ys_PD = ys_PD + jnp.take(ws["b_down_ED"], expert_P, axis=0)
    else:
        h_PF = act(gmm(xs_PD, ws["w_gate_EDF"])) * gmm(xs_PD, ws["w_up_EDF"])
        ys_PD = gmm(h_PF, ws["w_down_EFD"])
    unsort_P = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(order_P.shape[0], dtype=order_P.dtype))
    ys_tkD = jnp.take(ys_PD, unsort_P, axis=0).reshape(t, k, d)  # back in (token, choice) order
    out_tD = jnp.einsum("tkd,tk->td", ys_tkD, weights_tk.astype(ys_tkD.dtype))
    if "w_shared_gate_DS" in ws:  # Qwen3-Next / Qwen3.5-MoE: every token's shared expert, scaled by its own gate
        shared_tD = (act(x_tD @ ws["w_shared_gate_DS"]) * (x_tD @ ws["w_shared_up_DS"])) @ ws["w_shared_down_SD"]
        gate_t1 = jax.nn.sigmoid(jnp.einsum("td,d->t", x_tD, ws["w_shared_router_D"],
                                            preferred_element_type=jnp.float32))[:, None]
        out_tD = out_tD + (gate_t1 * shared_tD.astype(jnp.float32)).astype(out_tD.dtype)
    return out_tD


def router_sums(x_tD, w_DE, valid_t, k: int, b_E=None):
    """This device's ``(assignments [E], probability sums [E], valid tokens)``, each a float32 sum over valid tokens;
    differentiable through the probabilities (the assignments are counts)."""
    _, experts_tk, probs_tE = route(x_tD, w_DE, k, False, b_E)
    v_t = valid_t.astype(jnp.float32)
    assigned_E = jnp.zeros(probs_tE.shape[1], jnp.float32).at[experts_tk.reshape(-1)].add(jnp.repeat(v_t, k))
    return jax.lax.stop_gradient(assigned_E), jnp.einsum("te,t->e", probs_tE, v_t), jnp.sum(v_t)


def _shapes(cfg: ModelConfig) -> dict:
    """Each expert parameter of ``cfg.expert_style``: ``(shape, logical axes)``; the ``embed`` axis is FSDP-gathered."""
    d, e, f = cfg.hidden, cfg.num_experts, cfg.expert_mlp_dim
    router = {"w_router_DE": ((d, e), ("embed", "experts"))}
    down = {"w_down_EFD": ((e, f, d), ("experts", "mlp", "embed"))}
    if cfg.shared_expert_dim:  # a SwiGLU of its own width beside the routed experts, gated per token (sigmoid)
        z = cfg.shared_expert_dim
        down = {**down, "w_shared_gate_DS": ((d, z), ("embed", "mlp")), "w_shared_up_DS": ((d, z), ("embed", "mlp")),
                "w_shared_down_SD": ((z, d), ("mlp", "embed")), "w_shared_router_D": ((d,), ("embed",))}
    if cfg.expert_style == "gpt_oss":
        return {**router, "b_router_E": ((e,), ("experts",)),
                "w_gate_up_EDX": ((e, d, 2 * f), ("experts", "embed", "mlp")),
                "b_gate_up_EX": ((e, 2 * f), ("experts", "mlp")), **down,
                "b_down_ED": ((e, d), ("experts", "embed"))}
    return {**router, "w_gate_EDF": ((e, d, f), ("experts", "embed", "mlp")),
            "w_up_EDF": ((e, d, f), ("experts", "embed", "mlp")), **down}


class MoE(nnx.Module):
    """A sparse MLP's parameters (``_shapes``), stacked over the sparse layers (over every layer unless the model mixes
    dense and sparse ones: ``ModelConfig.stacked_apart``): router ``[D, E]``,
    the experts' gate and up ``[E, D, F]`` (gpt-oss: fused ``[E, D, 2F]``, interleaved, and biases), down
    ``[E, F, D]``."""

    def __init__(self, make: ParamMaker):
        self.cfg, self.mesh = make.cfg, make.mesh
        for name, (shape, names) in _shapes(self.cfg).items():
            init = "zeros" if name.startswith("b_") else "normal"
            setattr(self, name, make(f"moe.{name.rsplit('_', 1)[0]}", shape, names, init=init))

    def residual(self, x_BSD, valid_BS, norm_scale_D):
        """``(x + moe(rms_norm(x)), (assigned [E], prob sums [E], tokens))`` (``moe_sublayer``); ``norm_scale_D``: the
        pre-MLP norm's stored scale."""
        cfg, dt = self.cfg, self.cfg.compute_jnp_dtype
        ws = {name: getattr(self, name).get_value().astype(dt) for name in _shapes(cfg)}
        return moe_sublayer(x_BSD, valid_BS, norm_scale(norm_scale_D, cfg), ws, cfg=cfg, mesh=self.mesh)


def moe_sublayer(x_BSD, valid_BS, norm_D, ws: dict, *, cfg: ModelConfig, mesh: Mesh):
    """``(x + moe(rms_norm(x) * norm), (assigned [E], prob sums [E], tokens))``: the whole sparse sublayer on each
    device's tokens (module doc), the sums over the global batch. ``ws``: the expert parameters (``_shapes``) at rest,
    in the compute dtype; ``norm_D``: the float32 norm multiplier, at rest. With ``cfg.mlp_chunk`` the sublayer runs
    chunk by chunk."""
    over = cfg.shard_params_over_data
    wa = fsdp_axes(over)
    act_spec = P((DATA, FSDP), SEQ, None)
    platform = device_platform(mesh)
    impl = grouped_impl(cfg.moe_impl, platform)
    k, names = cfg.experts_per_token, list(_shapes(cfg))
    embed_axis = {n: names_.index("embed") if "embed" in names_ else None for n, (_, names_) in _shapes(cfg).items()}
    mlp = dict(k=k, renormalize=cfg.router_renormalize, impl=impl, act=mlp_activation(cfg), platform=platform,
               style=cfg.expert_style, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)

    def local(x_bsD, valid_bs, norm_D, *w_at_rest):
        norm_D = gather_param(norm_D, 0, over_data=over)
        w = {n: v if embed_axis[n] is None else gather_param(v, embed_axis[n], over_data=over)
             for n, v in zip(names, w_at_rest)}
        b, s, d = x_bsD.shape

        def sublayer(xc_bcD, nw):
            n_D, w = nw
            y_tD = experts_mlp(rms_norm(xc_bcD, n_D, cfg.rms_eps).reshape(-1, d), w, **mlp)
            return xc_bcD + y_tD.reshape(xc_bcD.shape).astype(xc_bcD.dtype)

        if cfg.mlp_chunk:
            out = chunk_map(sublayer, local_chunks(cfg.mlp_chunk, s, "mlp_chunk"), x_bsD, (norm_D, w))
        else:
            out = sublayer(x_bsD, (norm_D, w))
        sums = router_sums(rms_norm(x_bsD, norm_D, cfg.rms_eps).reshape(-1, d), w["w_router_DE"],
                           valid_bs.reshape(-1), k, w.get("b_router_E"))
        # per device, summed outside: a psum here would be transposed to a psum (check_vma is off for chunk_map)
        return out, tuple(v[None] for v in sums)

    def spec(n):
        shape, _ = _shapes(cfg)[n]
        return P(*(wa if i == embed_axis[n] else None for i in range(len(shape))))

    everywhere = P(MESH_AXES)
    specs = (act_spec, P((DATA, FSDP), SEQ), P(wa), *(spec(n) for n in names))
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(act_spec, (everywhere,) * 3), check_vma=False)
    out, sums = fn(x_BSD, valid_BS, norm_D, *(ws[n] for n in names))
    return out, tuple(jnp.sum(v, axis=0) for v in sums)
