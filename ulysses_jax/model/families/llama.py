"""Llama 3.x (``LlamaForCausalLM``): config.json both ways, its export rule, tensor names and presets.

The layout the other families start from: RMSNorm before both sublayers, GQA attention without biases, RoPE with the
``llama3`` frequency scaling (or YaRN, or none), a SwiGLU MLP; no sliding windows (a ``layer_types`` with sliding
layers is refused). Presets (the published ``config.json``; theta 500000, rms_eps 1e-5, vocab 128256):

| preset       | layers | hidden | heads | kv | head_dim | mlp   | scaling    | tied |
|--------------|--------|--------|-------|----|----------|-------|------------|------|
| llama3.2-1b  | 16     | 2048   | 32    | 8  | 64       | 8192  | llama3 x32 | yes  |
| llama3.2-3b  | 28     | 3072   | 24    | 8  | 128      | 8192  | llama3 x32 | yes  |
| llama3.1-8b  | 32     | 4096   | 32    | 8  | 128      | 14336 | llama3 x8  | no   |
| llama3.1-70b | 80     | 8192   | 64    | 8  | 128      | 28672 | llama3 x8  | no   |
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import llama_fields, llama_json, refuse
from ulysses_jax.model.families.tensors import llama_entries

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
ENTRIES = llama_entries()


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    """The Llama ``ModelConfig`` fields of ``raw`` (the shape is the generic reader's), refusing sliding layers."""
    if any(t != "full_attention" for t in raw.get("layer_types") or ()):
        refuse(where, "layer_types", sorted(set(raw["layer_types"])), "Llama has no sliding-window layers")
    return llama_fields(raw, where)


def claims(cfg, hint) -> bool:
    """Asked last: every dense model the families before it declined."""
    return True


def hf_config(cfg, dtype: str) -> dict:
    return {**llama_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "attention_bias": False, "mlp_bias": False}


_LLAMA3 = dict(rope_theta=500_000.0, rms_eps=1e-5, vocab_size=128_256, max_seq_len=131_072)
PRESETS = {
    "llama3.2-1b": dict(num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
                        rope_scaling=dict(factor=32.0), tie_embeddings=True, **_LLAMA3),
    "llama3.2-3b": dict(num_layers=28, hidden=3072, num_heads=24, num_kv_heads=8, head_dim=128, mlp_dim=8192,
                        rope_scaling=dict(factor=32.0), tie_embeddings=True, **_LLAMA3),
    "llama3.1-8b": dict(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                        rope_scaling=dict(factor=8.0), **_LLAMA3),
    "llama3.1-70b": dict(num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                         rope_scaling=dict(factor=8.0), **_LLAMA3),
}
