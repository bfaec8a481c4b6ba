"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): config.json both ways, its export rule, tensor names and presets.

The Llama layout with biases on q, k and v, and Qwen's sliding windows: with ``use_sliding_window``, the layers from
``max_window_layers`` on are local (or as ``layer_types`` lists them), which Qwen3 reads the same way.
Presets (theta 1e6, rms_eps 1e-6):

| preset       | layers | hidden | heads | kv | head_dim | mlp   | vocab  | tied |
|--------------|--------|--------|-------|----|----------|-------|--------|------|
| qwen2.5-0.5b | 24     | 896    | 14    | 2  | 64       | 4864  | 151936 | yes  |
| qwen2.5-7b   | 28     | 3584   | 28    | 4  | 128      | 18944 | 152064 | no   |
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import hf_layer_types, layer_fields, llama_fields, llama_json
from ulysses_jax.model.families.tensors import llama_entries

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 32}
ENTRIES = llama_entries()


def windows(raw: dict, where, num_layers: int) -> dict:
    """Qwen's sliding windows: none unless ``use_sliding_window`` (and a ``sliding_window``); then the layers from
    ``max_window_layers`` on (transformers' default 28), or as ``layer_types`` lists them."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return layer_fields({**raw, "layer_types": None}, where, num_layers, None, None)
    start = raw.get("max_window_layers", 28)
    derived = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    return layer_fields(raw, where, num_layers, None, derived)


def windows_json(cfg) -> dict:
    """Qwen's window keys of ``config.json`` (``sliding_window`` is written after the family's other keys)."""
    out = {"use_sliding_window": bool(cfg.sliding_window)}
    if cfg.sliding_window:
        types = hf_layer_types(cfg)
        out["layer_types"] = types
        out["max_window_layers"] = types.index("sliding_attention")
    return out


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return {**windows(raw, where, num_layers), **llama_fields(raw, where, attention_bias=True), "qkv_bias": True}


def claims(cfg, hint) -> bool:
    """A dense model with q/k/v biases (and no qk-norm: Qwen3 is asked first)."""
    return cfg.qkv_bias


def hf_config(cfg, dtype: str) -> dict:
    return {**llama_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), **windows_json(cfg),
            "sliding_window": cfg.sliding_window or None}


_QWEN = dict(rope_theta=1_000_000.0, rms_eps=1e-6)
PRESETS = {
    "qwen2.5-0.5b": dict(vocab_size=151_936, num_layers=24, hidden=896, num_heads=14, num_kv_heads=2, head_dim=64,
                         mlp_dim=4864, tie_embeddings=True, qkv_bias=True, max_seq_len=32_768, **_QWEN),
    "qwen2.5-7b": dict(vocab_size=152_064, num_layers=28, hidden=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                       mlp_dim=18944, qkv_bias=True, max_seq_len=131_072, **_QWEN),
}
