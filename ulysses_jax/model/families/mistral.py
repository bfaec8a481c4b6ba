"""Mistral (``MistralForCausalLM``): config.json both ways, its export rule, tensor names and presets.

The Llama layout with an optional sliding window on every layer (``sliding_window``; transformers' default 4096 when
the key is absent, none when it is null). On export a dense model without biases or qk-norm is Mistral rather than
Llama when it came from a Mistral folder, is named ``mistral...`` or has a window. Preset: ``mistral-7b`` is v0.3
(32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, mlp 14336, vocab 32768, theta 1e6, untied; no sliding
window: v0.1's 4096-token window is not modelled).
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import layer_fields, llama_fields, llama_json
from ulysses_jax.model.families.tensors import llama_entries

ARCHITECTURE = "MistralForCausalLM"
MODEL_TYPE = "mistral"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 8}
ENTRIES = llama_entries()


def windows(raw: dict, where, num_layers: int, default: int | None) -> dict:
    """Every layer local when ``sliding_window`` is set (``default`` when the key is absent), else every layer
    global; a ``layer_types`` in the file is not read (the window is the model's, Mixtral's too)."""
    window = raw.get("sliding_window", default)
    derived = ["full_attention" if window is None else "sliding_attention"] * num_layers
    return layer_fields({**raw, "layer_types": None}, where, num_layers, 4096, derived)


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return {**windows(raw, where, num_layers, 4096), **llama_fields(raw, where)}


def claims(cfg, hint) -> bool:
    """A dense model without biases or qk-norm that came from a Mistral folder, is named so or has a window on every
    layer (one that mixes local and global layers is refused: no architecture here holds it)."""
    if cfg.sliding_window and "global" in (cfg.layer_pattern or ("local",)):
        raise ValueError("a model mixing local and global layers without q/k/v bias or qk-norm has no Hugging Face "
                         "architecture here (Mistral windows every layer); use one kind of layer, or export as Qwen")
    return hint == [ARCHITECTURE] or cfg.name.lower().startswith("mistral") or bool(cfg.sliding_window)


def hf_config(cfg, dtype: str) -> dict:
    return {**llama_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "sliding_window": cfg.sliding_window or None}


PRESETS = {
    "mistral-7b": dict(vocab_size=32_768, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       mlp_dim=14336, rope_theta=1_000_000.0, rms_eps=1e-5, max_seq_len=32_768),
}
