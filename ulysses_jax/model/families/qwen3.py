"""Qwen3 (``Qwen3ForCausalLM``): config.json both ways, its export rule, tensor names and presets.

The Llama layout with an RMSNorm over ``head_dim`` on q and k before RoPE (qk-norm), no biases, and Qwen2's sliding
windows. Presets (theta 1e6, rms_eps 1e-6, vocab 151936, 40960 positions; ``head_dim * heads`` need not be ``hidden``):

| preset     | layers | hidden | heads | kv | head_dim | mlp   | tied |
|------------|--------|--------|-------|----|----------|-------|------|
| qwen3-0.6b | 28     | 1024   | 16    | 8  | 128      | 3072  | yes  |
| qwen3-4b   | 36     | 2560   | 32    | 8  | 128      | 9728  | yes  |
| qwen3-8b   | 36     | 4096   | 32    | 8  | 128      | 12288 | no   |
"""

from __future__ import annotations

from ulysses_jax.model.families import qwen2
from ulysses_jax.model.families.fields import llama_fields, llama_json
from ulysses_jax.model.families.tensors import llama_entries

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128}
ENTRIES = llama_entries()


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return {**qwen2.windows(raw, where, num_layers), **llama_fields(raw, where), "qk_norm": True}


def claims(cfg, hint) -> bool:
    """A dense model with qk-norm (refused with q/k/v biases too, which no architecture here has)."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("a model with both qk_norm and qkv_bias has no Hugging Face architecture here; drop one")
    return cfg.qk_norm


def hf_config(cfg, dtype: str) -> dict:
    return {**llama_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "attention_bias": False, **qwen2.windows_json(cfg),
            "sliding_window": cfg.sliding_window or None}


_QWEN3 = dict(vocab_size=151_936, head_dim=128, qk_norm=True, max_seq_len=40_960, rope_theta=1_000_000.0,
              rms_eps=1e-6)
PRESETS = {
    "qwen3-0.6b": dict(num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, mlp_dim=3072, tie_embeddings=True,
                       **_QWEN3),
    "qwen3-4b": dict(num_layers=36, hidden=2560, num_heads=32, num_kv_heads=8, mlp_dim=9728, tie_embeddings=True,
                     **_QWEN3),
    "qwen3-8b": dict(num_layers=36, hidden=4096, num_heads=32, num_kv_heads=8, mlp_dim=12288, **_QWEN3),
}
