"""gpt-oss (``GptOssForCausalLM``): config.json both ways, its export rule, tensor names and presets.

Sliding (128 tokens) and full layers alternating, biases on q, k, v and o (``attention_bias``), a learned sink logit
per head (``attn_sinks``), YaRN RoPE, and every layer sparse with gpt-oss's experts (``expert_style``: a router bias,
gate and up fused and interleaved with biases, the clamped SwiGLU of ``swiglu_limit`` / ``swiglu_alpha``). The Hub's
MXFP4 expert weights are dequantised on import (``interop/mxfp4.py``); other quantisations are refused.

Presets (vocab 201088, hidden 2880, 64 heads, 8 KV heads, head_dim 64, experts of 2880, top-4 renormalised, YaRN x32
of 4096 with theta 150000, router_aux_loss_coef 0.9 as published):

| preset       | layers | experts | total / active |
|--------------|--------|---------|----------------|
| gpt-oss-20b  | 24     | 32      | 20.9B / 3.6B   |
| gpt-oss-120b | 36     | 128     | 116.8B / 5.1B  |
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import (
    expert_fields,
    expert_json,
    hf_layer_types,
    layer_fields,
    llama_fields,
    llama_json,
)
from ulysses_jax.model.families.tensors import LAYER, Entry, llama_entries

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 64, "rope_theta": 150_000.0, "rms_norm_eps": 1e-5,
               "attention_bias": True}
# every expert in one tensor per layer, gate and up fused with interleaved columns (X = 2G), biases; on the Hub the
# two expert matrices are MXFP4 ``_blocks`` + ``_scales`` (interop/mxfp4.py)
ENTRIES = llama_entries(mlp=(
    Entry("blocks.moe.w_router_DE", "DE", LAYER + "mlp.router.weight", "E,D", "experts"),
    Entry("blocks.moe.b_router_E", "E", LAYER + "mlp.router.bias", "E", "experts"),
    Entry("blocks.moe.w_gate_up_EDX", "EDX", LAYER + "mlp.experts.gate_up_proj", "E,D,X", "experts"),
    Entry("blocks.moe.b_gate_up_EX", "EX", LAYER + "mlp.experts.gate_up_proj_bias", "E,X", "experts"),
    Entry("blocks.moe.w_down_EFD", "EGD", LAYER + "mlp.experts.down_proj", "E,G,D", "experts"),
    Entry("blocks.moe.b_down_ED", "ED", LAYER + "mlp.experts.down_proj_bias", "E,D", "experts"),
))


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    # transformers' default layers: sliding 0, 2, 4, ..., full ones between
    derived = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    out = {**layer_fields(raw, where, num_layers, 128, derived), **llama_fields(raw, where, attention_bias=True),
           "qkv_bias": bool(raw["attention_bias"]), **expert_fields(raw, where, "num_local_experts")}
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, "mxfp4"):
        raise ValueError(f"{where}: quantization_config.quant_method = {method!r} is not supported (ulysses_jax "
                         f"dequantises gpt-oss's MXFP4 expert weights only); use the original or a bfloat16 folder")
    if not raw.get("attention_bias", True):
        raise ValueError(f"{where}: attention_bias = false is not modelled for gpt-oss (its q, k, v and o have biases)")
    return dict(out, o_bias=True, attn_sinks=True, expert_style="gpt_oss", router_renormalize=True,
                swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))


def claims(cfg, hint) -> bool:
    """A mixture of gpt-oss's experts (asked first among the mixtures), refused without its attention."""
    if not (cfg.num_experts and cfg.expert_style == "gpt_oss"):
        return False
    if not (cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks) or cfg.qk_norm:
        raise ValueError(f"gpt-oss experts export as {ARCHITECTURE}, which has q/k/v/o biases and attention "
                         f"sinks and no qk-norm; this model differs")
    return True


def hf_config(cfg, dtype: str) -> dict:
    return {**llama_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "attention_bias": True,
            "layer_types": hf_layer_types(cfg), "sliding_window": cfg.sliding_window or None, **expert_json(cfg),
            "num_local_experts": cfg.num_experts, "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha}


_GPT_OSS = dict(
    vocab_size=201_088, hidden=2880, num_heads=64, num_kv_heads=8, head_dim=64, mlp_dim=2880, rope_theta=150_000.0,
    rope_scaling=dict(factor=32.0, original_max_position=4096, rope_type="yarn", truncate=False),
    rms_eps=1e-5, max_seq_len=131_072, sliding_window=128, layer_pattern=("local", "global"), qkv_bias=True,
    o_bias=True, attn_sinks=True, experts_per_token=4, router_renormalize=True, expert_style="gpt_oss",
    router_aux_loss_coef=0.9)
PRESETS = {
    "gpt-oss-20b": dict(num_layers=24, num_experts=32, **_GPT_OSS),
    "gpt-oss-120b": dict(num_layers=36, num_experts=128, **_GPT_OSS),
}
