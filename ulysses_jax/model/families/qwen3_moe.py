"""Qwen3-MoE (``Qwen3MoeForCausalLM``): config.json both ways, its export rule, tensor names and presets.

Qwen3 (qk-norm; its own windows: with ``use_sliding_window`` every layer local) with routed experts
(``model/moe.py``): ``num_experts`` (transformers 5 writes ``num_local_experts``), ``num_experts_per_tok``,
``moe_intermediate_size`` (an expert's width; ``intermediate_size`` is the dense layers'), ``norm_topk_prob``
(renormalised top-k weights), ``router_aux_loss_coef``, and a layer is sparse unless it is in ``mlp_only_layers``
or ``(i + 1) % decoder_sparse_step != 0``. Preset ``qwen3-30b-a3b``: 48 layers, hidden 2048, 32 heads, 4 KV heads,
head_dim 128, 128 experts, top-8 renormalised, expert width 768, vocab 151936, every layer sparse (30.5B parameters,
3.3B active).
"""

from __future__ import annotations

from ulysses_jax.model.families import qwen3
from ulysses_jax.model.families.fields import (
    expert_fields,
    expert_json,
    integer,
    layer_fields,
    refuse_gpt_oss_attention,
)
from ulysses_jax.model.families.tensors import DENSE_MLP, LAYER, Entry, llama_entries

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 4}
# the router and one tensor per expert {j} (G: an expert's width, moe_mlp_dim), after the dense layers' MLP
ENTRIES = llama_entries(mlp=(
    *DENSE_MLP,
    Entry("blocks.moe.w_router_DE", "DE", LAYER + "mlp.gate.weight", "E,D", "experts"),
    Entry("blocks.moe.w_gate_EDF", "EDG", LAYER + "mlp.experts.{j}.gate_proj.weight", "G,D", "experts"),
    Entry("blocks.moe.w_up_EDF", "EDG", LAYER + "mlp.experts.{j}.up_proj.weight", "G,D", "experts"),
    Entry("blocks.moe.w_down_EFD", "EGD", LAYER + "mlp.experts.{j}.down_proj.weight", "D,G", "experts"),
))


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    """Qwen3's fields and the experts', the dense layers among the sparse ones included, with Qwen3-MoE's windows."""
    return {**qwen3.fields(raw, where, num_layers, head_dim), **windows(raw, where, num_layers),
            **sparse_fields(raw, where, num_layers)}


def windows(raw: dict, where, num_layers: int) -> dict:
    """Qwen3-MoE's windows: its class reads neither ``layer_types`` nor ``max_window_layers`` (Qwen3's do): with
    ``use_sliding_window`` and a ``sliding_window``, every layer is local."""
    local = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
    return layer_fields({**raw, "layer_types": None}, where, num_layers, None,
                        ["sliding_attention"] * num_layers if local else None)


def sparse_fields(raw: dict, where, num_layers: int) -> dict:
    """The routed experts of a Qwen MoE ``config.json`` (Qwen3-Next reads the same keys): their count, top-k, width,
    renormalisation and the dense layers (``mlp_only_layers``, ``decoder_sparse_step``)."""
    out = expert_fields(raw, where, "num_experts" if "num_experts" in raw else "num_local_experts")
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step = {step!r} must be a positive integer; fix config.json")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in only):
        raise ValueError(f"{where}: mlp_only_layers = {only!r} must list layer indices in 0..{num_layers - 1}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if len(dense) == num_layers:
        raise ValueError(f"{where}: mlp_only_layers / decoder_sparse_step leave no sparse layer; this is a dense "
                         f"model: use a folder of its dense relative")
    return {**out, "moe_mlp_dim": integer(raw, "moe_intermediate_size", where), "dense_layers": dense,
            "router_renormalize": bool(raw.get("norm_topk_prob", False))}


def claims(cfg, hint) -> bool:
    """A mixture of experts with qk-norm and no q/k/v bias (asked after gpt-oss, before Mixtral)."""
    if not cfg.num_experts:
        return False
    refuse_gpt_oss_attention(cfg)
    return cfg.qk_norm and not cfg.qkv_bias


def hf_config(cfg, dtype: str) -> dict:
    if cfg.sliding_window and "global" in cfg.layer_pattern:
        raise ValueError(f"{cfg.name} mixes local and global layers, which {ARCHITECTURE} cannot hold (its window "
                         f"applies to every layer or to none); export it with sliding_window 0 or every layer local")
    out = {**qwen3.hf_config(cfg, dtype), "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
           **expert_json(cfg), "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_mlp_dim,
           "norm_topk_prob": cfg.router_renormalize, "decoder_sparse_step": 1,
           "mlp_only_layers": list(cfg.dense_layers)}
    return {k: v for k, v in out.items() if k not in ("layer_types", "max_window_layers")}


PRESETS = {
    "qwen3-30b-a3b": dict(vocab_size=151_936, num_layers=48, hidden=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                          mlp_dim=6144, qk_norm=True, max_seq_len=40_960, num_experts=128, experts_per_token=8,
                          moe_mlp_dim=768, router_renormalize=True, router_aux_loss_coef=0.001,
                          rope_theta=1_000_000.0, rms_eps=1e-6),
}
