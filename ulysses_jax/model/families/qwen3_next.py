"""Qwen3-Next (``Qwen3NextForCausalLM``, ``model_type`` ``qwen3_next``): config.json both ways, its export rule, tensor
names and presets.

The hybrid of Qwen3.5 (``families/qwen3_5.py``) with Qwen3.5-MoE's experts and shared expert
(``families/qwen3_5_moe.py``), read as a Qwen MoE config (``norm_topk_prob``, ``mlp_only_layers``,
``decoder_sparse_step``: dense layers may sit among the sparse ones, ``intermediate_size`` wide). Its delta-net fuses
the input projections per key head: ``in_proj_qkvz`` holds, for each key head in turn, its q rows, its k rows, then the
v rows and the z rows of the value heads it serves; ``in_proj_ba`` holds per key head the b rows then the a rows of
those value heads. The convolution's channels are q of every head, k of every head, v of every head, as in Qwen3.5.

Export writes a hybrid mixture of experts as this class when the source folder was one (or the run's preset is
this family's), or when the model has what Qwen3.5-MoE cannot hold (dense layers, top-k weights not renormalised).

Preset ``qwen3-next-80b-a3b``: transformers' ``Qwen3NextConfig()`` defaults (48 layers, hidden 2048, 16 heads, 2 KV
heads, head_dim 256, 512 experts of 512, top-10 renormalised, a shared expert of 512, 16 / 32 delta-net heads of 128,
vocab 151936).
"""

from __future__ import annotations

from ulysses_jax.model.families import qwen3_5, qwen3_5_moe, qwen3_moe
from ulysses_jax.model.families.fields import expert_json
from ulysses_jax.model.families.tensors import DENSE_MLP, LAYER, Entry, Fused

ARCHITECTURE = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256}
MODELLED_EXPERT_KEYS = qwen3_5_moe.MODELLED_EXPERT_KEYS
IGNORED_PREFIXES = qwen3_5.IGNORED_PREFIXES
_QKVZ, _BA = LAYER + "linear_attn.in_proj_qkvz.weight", LAYER + "linear_attn.in_proj_ba.weight"
_PER_KEY_HEAD, _BA_PIECES = ("Q", "Q", "MW", "MW"), ("M", "M")  # M: value heads per key head
DELTA = (
    Entry("blocks.delta.wq_DJQ", "DJQ", _QKVZ, "JQ,D", fused=Fused("J", _PER_KEY_HEAD, 0)),
    Entry("blocks.delta.wk_DJQ", "DJQ", _QKVZ, "JQ,D", fused=Fused("J", _PER_KEY_HEAD, 1)),
    Entry("blocks.delta.wv_DUW", "DUW", _QKVZ, "UW,D", fused=Fused("J", _PER_KEY_HEAD, 2)),
    Entry("blocks.delta.wz_DUW", "DUW", _QKVZ, "UW,D", fused=Fused("J", _PER_KEY_HEAD, 3)),
    Entry("blocks.delta.wb_DU", "DU", _BA, "U,D", fused=Fused("J", _BA_PIECES, 0)),
    Entry("blocks.delta.wa_DU", "DU", _BA, "U,D", fused=Fused("J", _BA_PIECES, 1)),
    *qwen3_5.DELTA_REST,
)
ENTRIES = qwen3_5.hybrid_entries(delta=DELTA, mlp=(*DENSE_MLP, *qwen3_5_moe.EXPERTS))


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return {**qwen3_5.hybrid_fields(raw, where, num_layers), **qwen3_moe.sparse_fields(raw, where, num_layers),
            **qwen3_5_moe.shared_fields(raw, where)}


def claims(cfg, hint) -> bool:
    """A hybrid with experts from a Qwen3-Next folder, or one Qwen3.5-MoE cannot hold (asked before it)."""
    if not qwen3_5.is_hybrid(cfg) or not cfg.num_experts:
        return False
    ours = hint == [ARCHITECTURE] or cfg.name.startswith("qwen3-next")  # its folder, or its preset
    if not ours and not (cfg.dense_layers or not cfg.router_renormalize):
        return False
    qwen3_5.check_hybrid(cfg, ARCHITECTURE)
    qwen3_5_moe.check_experts(cfg, ARCHITECTURE)
    return True


def hf_config(cfg, dtype: str) -> dict:
    return {**qwen3_5.hybrid_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "intermediate_size": cfg.mlp_dim,
            **expert_json(cfg), "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_dim, "norm_topk_prob": cfg.router_renormalize,
            "decoder_sparse_step": 1, "mlp_only_layers": list(cfg.dense_layers)}


PRESETS = {
    "qwen3-next-80b-a3b": dict(vocab_size=151_936, num_layers=48, hidden=2048, num_heads=16, num_kv_heads=2,
                               mlp_dim=5632, num_experts=512, experts_per_token=10, moe_mlp_dim=512,
                               shared_expert_dim=512, router_renormalize=True, router_aux_loss_coef=0.001,
                               **qwen3_5.HYBRID),
}
