"""Qwen3.5-MoE text (``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``): config.json both ways, its export
rule, tensor names and presets.

Qwen3.5's hybrid (``families/qwen3_5.py``: delta-net and gated full-attention layers) with every layer's MLP a mixture
of experts: a top-k router whose weights are always renormalised, the routed experts (one tensor per expert, as
transformers writes them and reads them back), and a shared expert (``shared_expert_intermediate_size``): a SwiGLU
every token passes through, times ``sigmoid(shared_expert_gate(x))``. There is no dense layer, so no
``intermediate_size``; the model's ``mlp_dim`` (unused) takes the experts' width.

Preset ``qwen3.5-35b-a3b``: transformers' ``Qwen3_5MoeTextConfig()`` defaults (40 layers, hidden 2048, 16 heads, 2 KV
heads, head_dim 256, 256 experts of 512, top-8, a shared expert of 512, 16 / 32 delta-net heads of 128, vocab 248320).
"""

from __future__ import annotations

from ulysses_jax.model.families import qwen3_5
from ulysses_jax.model.families.fields import expert_fields, expert_json, integer
from ulysses_jax.model.families.tensors import LAYER, Entry

ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MODEL_TYPE = "qwen3_5_moe_text"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256}
MODELLED_EXPERT_KEYS = ("shared_expert_intermediate_size",)
IGNORED_PREFIXES = qwen3_5.IGNORED_PREFIXES
# the router, one tensor per expert {j} (G: an expert's width), the shared expert (Z: its width) and its gate
EXPERTS = (
    Entry("blocks.moe.w_router_DE", "DE", LAYER + "mlp.gate.weight", "E,D", "experts"),
    Entry("blocks.moe.w_gate_EDF", "EDG", LAYER + "mlp.experts.{j}.gate_proj.weight", "G,D", "experts"),
    Entry("blocks.moe.w_up_EDF", "EDG", LAYER + "mlp.experts.{j}.up_proj.weight", "G,D", "experts"),
    Entry("blocks.moe.w_down_EFD", "EGD", LAYER + "mlp.experts.{j}.down_proj.weight", "D,G", "experts"),
    Entry("blocks.moe.w_shared_gate_DS", "DZ", LAYER + "mlp.shared_expert.gate_proj.weight", "Z,D", "shared_expert"),
    Entry("blocks.moe.w_shared_up_DS", "DZ", LAYER + "mlp.shared_expert.up_proj.weight", "Z,D", "shared_expert"),
    Entry("blocks.moe.w_shared_down_SD", "ZD", LAYER + "mlp.shared_expert.down_proj.weight", "D,Z", "shared_expert"),
    Entry("blocks.moe.w_shared_router_D", "D", LAYER + "mlp.shared_expert_gate.weight", "O,D", "shared_expert"),
)
ENTRIES = qwen3_5.hybrid_entries(mlp=EXPERTS)


def language_config(raw: dict, where) -> dict:
    """No dense layer, so no ``intermediate_size``: the generic reader's MLP width is the experts' (unused)."""
    return {**raw, "intermediate_size": raw.get("intermediate_size") or raw.get("moe_intermediate_size")}


def shared_fields(raw: dict, where) -> dict:
    """The routed experts and the shared one (every hybrid MoE has both)."""
    return {**expert_fields(raw, where, "num_experts"), "moe_mlp_dim": integer(raw, "moe_intermediate_size", where),
            "shared_expert_dim": integer(raw, "shared_expert_intermediate_size", where)}


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return {**qwen3_5.hybrid_fields(raw, where, num_layers), **shared_fields(raw, where), "router_renormalize": True}


def check_experts(cfg, architecture: str) -> None:
    """A hybrid mixture of experts has a shared expert with SwiGLU experts."""
    if not cfg.shared_expert_dim or cfg.expert_style != "swiglu":
        raise ValueError(f"{cfg.name} exports as {architecture}, whose every sparse layer has SwiGLU experts and a "
                         f"shared expert; this one has shared_expert_dim={cfg.shared_expert_dim}, expert_style="
                         f"{cfg.expert_style!r}")


def claims(cfg, hint) -> bool:
    """A hybrid with experts in every layer, renormalised (asked after Qwen3-Next, which takes the others)."""
    if not qwen3_5.is_hybrid(cfg) or not cfg.num_experts:
        return False
    qwen3_5.check_hybrid(cfg, ARCHITECTURE)
    check_experts(cfg, ARCHITECTURE)
    return True


def hf_config(cfg, dtype: str) -> dict:
    return {**qwen3_5.hybrid_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), **expert_json(cfg),
            "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_dim}


PRESETS = {
    "qwen3.5-35b-a3b": dict(vocab_size=248_320, num_layers=40, hidden=2048, num_heads=16, num_kv_heads=2, mlp_dim=512,
                            num_experts=256, experts_per_token=8, moe_mlp_dim=512, shared_expert_dim=512,
                            router_renormalize=True, router_aux_loss_coef=0.001, **qwen3_5.HYBRID),
}
