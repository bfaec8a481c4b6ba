"""Gemma 3 text (``Gemma3ForCausalLM``): config.json both ways, its export rule, tensor names and presets.

Gemma 3 differs from the Llama layout in ways ``ModelConfig`` names (``model/transformer.py`` implements them): norms
before *and* after both sublayers (``post_norms``), norm scales stored as ``w`` and applied as ``1 + w``
(``norm_plus_one``), per-head q/k norms, a gated MLP with the tanh GELU (``mlp_activation="gelu_tanh"``), embeddings
times ``sqrt(hidden)``, the attention scale ``query_pre_attn_scalar ** -0.5``, five local layers (a sliding window)
to one global one, local layers with their own RoPE base and global ones with a linear scaling, tied embeddings.
Read from transformers 5's ``rope_parameters`` (per layer type) or 4's ``rope_theta`` + ``rope_local_base_freq`` +
``rope_scaling``; written in the latter layout, which both read. The vision-language folders are refused.

Presets (the 4B's language model; theta 1e6, local base 10000, head_dim 256, attention scale 1/sqrt(256), tied):

| preset    | layers | hidden | heads | kv | mlp   | vocab  | window | scaling   |
|-----------|--------|--------|-------|----|-------|--------|--------|-----------|
| gemma3-1b | 26     | 1152   | 4     | 1  | 6912  | 262144 | 512    | -         |
| gemma3-4b | 34     | 2560   | 8     | 4  | 10240 | 262208 | 1024   | linear x8 |
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import hf_layer_types, layer_fields, refuse
from ulysses_jax.model.families.tensors import ATTENTION, DENSE_MLP, LAYER, OUTPUT, Entry

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256}
# "post_attention_layernorm" is the norm after the attention here; the MLP's own norms come before and after it
ENTRIES = (
    *ATTENTION,
    Entry("blocks.post_attn_norm.scale", "D", LAYER + "post_attention_layernorm.weight", "D"),
    Entry("blocks.mlp_norm.scale", "D", LAYER + "pre_feedforward_layernorm.weight", "D"),
    Entry("blocks.post_mlp_norm.scale", "D", LAYER + "post_feedforward_layernorm.weight", "D"),
    *DENSE_MLP,
    *OUTPUT,
)


def screen(raw: dict, where) -> None:
    """Refuse a Gemma 3 vision-language folder (asked of every folder, before its architecture is looked up)."""
    gemma = str(raw.get("model_type", "")).startswith("gemma")  # other families' vision-language folders pass
    if raw.get("model_type") == "gemma3" or ("vision_config" in raw and gemma) or raw.get("architectures") == [
            "Gemma3ForConditionalGeneration"]:
        raise ValueError(f"{where} is a Gemma 3 vision-language model (text_config + vision_config); ulysses_jax "
                         f"takes Gemma 3 text only and would ignore the vision tower: use a {ARCHITECTURE} folder "
                         f"(model_type '{MODEL_TYPE}', e.g. gemma-3-1b)")


def _rope(raw: dict, where) -> dict:
    params = raw.get("rope_parameters")
    if params is not None:  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        if not isinstance(params, dict) or not {"full_attention", "sliding_attention"} <= set(params):
            refuse(where, "rope_parameters", params, "expected one entry per layer type")
        full, local = params["full_attention"], params["sliding_attention"]
    else:
        full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        refuse(where, "sliding_attention rope_type", local["rope_type"], "local layers take plain RoPE")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        refuse(where, "full_attention rope_type", kind, "Gemma 3's global layers take 'default' or 'linear' RoPE")
    scaling = dict(rope_type="linear", factor=float(full["factor"])) if kind == "linear" else None
    return dict(rope_theta=float(full["rope_theta"]), rope_local_theta=float(local["rope_theta"]),
                rope_scaling=scaling)


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    """The Gemma 3 ``ModelConfig`` fields of ``raw`` (the shape is the generic reader's)."""
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        refuse(where, "hidden_activation", act, "Gemma 3's MLP is GeGLU with the tanh GELU")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(field) is not None:
            refuse(where, field, raw[field], "logit soft-capping (Gemma 2)")
    if raw.get("use_bidirectional_attention"):
        refuse(where, "use_bidirectional_attention", True, "EmbeddingGemma's bidirectional attention")
    if raw.get("attention_bias"):
        refuse(where, "attention_bias", True, "attention biases")
    pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
    derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return dict(**_rope(raw, where), **layer_fields(raw, where, num_layers, 4096, derived),
                post_norms=True, norm_plus_one=True, mlp_activation="gelu_tanh", scale_embeddings=True,
                qk_norm=True, qkv_bias=False, query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", head_dim)),
                tie_embeddings=bool(raw.get("tie_word_embeddings", True)))


def claims(cfg, hint) -> bool:
    """Asked first: any model with norms after its sublayers (``hf_config`` refuses one without every other Gemma 3
    switch)."""
    return cfg.post_norms


def check_exportable(cfg) -> None:
    """Gemma 3's architecture holds a model with every Gemma-3 switch on; refuse a mix with the Llama family's."""
    need = dict(post_norms=True, norm_plus_one=True, mlp_activation="gelu_tanh", scale_embeddings=True, qk_norm=True,
                qkv_bias=False)
    for field, value in need.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"a model with post_norms is exported as {ARCHITECTURE}, which needs "
                             f"{field}={value!r}, but this one has {getattr(cfg, field)!r}; no Hugging Face "
                             f"architecture here holds it")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "linear":
        raise ValueError(f"{ARCHITECTURE} scales RoPE linearly; this model has {cfg.rope_scaling.rope_type!r}")


def _int_if_whole(x: float):
    return int(x) if float(x).is_integer() else float(x)


def hf_config(cfg, dtype: str) -> dict:
    """The ``config.json`` entries of a Gemma 3 text model (transformers 4's layout, which 5 converts)."""
    check_exportable(cfg)
    sc = cfg.rope_scaling
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": cfg.rope_local_theta or cfg.rope_theta,
        "rope_scaling": None if sc is None else {"rope_type": "linear", "factor": sc.factor},
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),  # transformers: an int
        "sliding_window": cfg.sliding_window or None, "layer_types": hf_layer_types(cfg),
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "torch_dtype": dtype,
    }


_GEMMA3 = dict(rope_theta=1_000_000.0, rope_local_theta=10_000.0, rms_eps=1e-6, head_dim=256,
               layer_pattern=("local",) * 5 + ("global",), tie_embeddings=True, qk_norm=True, post_norms=True,
               norm_plus_one=True, mlp_activation="gelu_tanh", scale_embeddings=True, query_pre_attn_scalar=256.0)
PRESETS = {
    "gemma3-1b": dict(vocab_size=262_144, num_layers=26, hidden=1152, num_heads=4, num_kv_heads=1, mlp_dim=6912,
                      sliding_window=512, max_seq_len=32_768, **_GEMMA3),
    "gemma3-4b": dict(vocab_size=262_208, num_layers=34, hidden=2560, num_heads=8, num_kv_heads=4, mlp_dim=10240,
                      sliding_window=1024, rope_scaling=dict(factor=8.0, rope_type="linear"), max_seq_len=131_072,
                      **_GEMMA3),
}
