"""Mixtral (``MixtralForCausalLM``): config.json both ways, its export rule, tensor names and presets.

Mistral (its window on every layer; transformers' Mixtral has none by default) with routed experts in every layer:
``num_local_experts`` experts of ``intermediate_size``, ``num_experts_per_tok``, the top-k weights always
renormalised, ``router_aux_loss_coef``; the router's training noise (``router_jitter_noise``) is refused. Preset
``mixtral-8x7b``: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, 8 experts of 14336, top-2, vocab 32000,
theta 1e6 (46.7B parameters, 12.9B active).
"""

from __future__ import annotations

from ulysses_jax.model.families import mistral
from ulysses_jax.model.families.fields import expert_fields, expert_json, llama_fields, refuse_gpt_oss_attention
from ulysses_jax.model.families.tensors import LAYER, Entry, llama_entries

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 8, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}
# the router and one tensor per expert {j} (G: an expert's width, mlp_dim here); no dense MLP
ENTRIES = llama_entries(mlp=(
    Entry("blocks.moe.w_router_DE", "DE", LAYER + "block_sparse_moe.gate.weight", "E,D", "experts"),
    Entry("blocks.moe.w_gate_EDF", "EDG", LAYER + "block_sparse_moe.experts.{j}.w1.weight", "G,D", "experts"),
    Entry("blocks.moe.w_up_EDF", "EDG", LAYER + "block_sparse_moe.experts.{j}.w3.weight", "G,D", "experts"),
    Entry("blocks.moe.w_down_EFD", "EGD", LAYER + "block_sparse_moe.experts.{j}.w2.weight", "D,G", "experts"),
))


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    out = {**mistral.windows(raw, where, num_layers, None), **llama_fields(raw, where),
           **expert_fields(raw, where, "num_local_experts")}
    if raw.get("router_jitter_noise"):
        raise ValueError(f"{where}: router_jitter_noise = {raw['router_jitter_noise']!r} is not supported (noise "
                         f"on the router's input in training); set it to 0")
    return {**out, "router_renormalize": True}


def claims(cfg, hint) -> bool:
    """Every mixture of experts that gpt-oss and Qwen3-MoE declined, refusing what Mixtral cannot hold."""
    if not cfg.num_experts:
        return False
    refuse_gpt_oss_attention(cfg)
    if cfg.qkv_bias or cfg.dense_layers or not cfg.router_renormalize or cfg.expert_mlp_dim != cfg.mlp_dim:
        raise ValueError("a mixture of experts without qk-norm exports as Mixtral, which has no q/k/v bias, no dense "
                         "layers, experts as wide as mlp_dim and renormalised top-k weights; this model differs")
    return True


def hf_config(cfg, dtype: str) -> dict:
    return {**mistral.hf_config(cfg, dtype), "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            **expert_json(cfg), "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0}


PRESETS = {
    "mixtral-8x7b": dict(vocab_size=32_000, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=14336, rope_theta=1_000_000.0, rms_eps=1e-5, max_seq_len=32_768, num_experts=8,
                         experts_per_token=2, router_renormalize=True, router_aux_loss_coef=0.02),
}
