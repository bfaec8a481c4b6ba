"""Qwen3.5 text (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``): config.json both ways, its export rule,
tensor names and presets; and what the hybrid families share (Qwen3.5-MoE, Qwen3-Next and the vision-language folder
import this module).

A hybrid: ``layer_types`` of ``linear_attention`` (the gated delta-net, ``model/delta_net.py``) and ``full_attention``
(three to one by default, ``full_attention_interval``). The full-attention layers gate their output per head (``q_proj``
yields ``[q | gate]`` per head, ``attn_output_gate``), rotate the first quarter of each head's dims
(``partial_rotary_factor`` 0.25) and norm q and k per head; every RMSNorm but the delta-net's gated one scales by
``1 + w`` (``norm_plus_one``). transformers' Qwen3.5 rotates by a multimodal RoPE (``mrope_section``: three position
streams, text, height and width, interleaved over the frequencies); for text the three streams are one, so it is the
plain partial RoPE. The delta-net's tensors: ``in_proj_qkv`` (q, k, v rows one after the other), ``in_proj_z``,
``in_proj_b``, ``in_proj_a``, ``conv1d`` (``[channels, 1, K]`` over the same q, k, v channels), ``A_log``,
``dt_bias``, ``norm`` and ``out_proj``. Multi-token-prediction tensors (``mtp.*``) are not read and not written.

Preset ``qwen3.5-9b``: transformers' ``Qwen3_5TextConfig()`` defaults (32 layers, hidden 4096, 16 heads, 4 KV heads,
head_dim 256, MLP 12288, 16 / 32 delta-net key / value heads of 128, vocab 248320, theta 10000, 32768 positions).
"""

from __future__ import annotations

from ulysses_jax.model.families.fields import (
    integer,
    llama_fields,
    partial_rotary_factor,
    refuse,
)
from ulysses_jax.model.families.tensors import ATTENTION, DENSE_MLP, LAYER, MLP_NORM, OUTPUT, Entry, Fused

ARCHITECTURE = "Qwen3_5ForCausalLM"
MODEL_TYPE = "qwen3_5_text"
# config.json keys a folder may leave out, at transformers' defaults for this class where the generic reader's differ
HF_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256}
HF_KINDS = {"linear_attention": "linear", "full_attention": "global"}
IGNORED_PREFIXES = ("mtp.",)  # multi-token prediction: transformers ignores it too

# the full-attention layers: q_proj doubled per head (Y = 2 H: [q | gate]), no biases, no sinks
GATED_ATTENTION = tuple(
    Entry("blocks.attn.wq_DNH", "DNY", LAYER + "self_attn.q_proj.weight", "NY,D") if e.param == "blocks.attn.wq_DNH"
    else e for e in ATTENTION if e.when in (None, "qk_norm"))
_QKV, _CONV = Fused("", ("JQ", "JQ", "UW"), 0), LAYER + "linear_attn.conv1d.weight"
# the delta-net's tensors but its input projections (a family's own); conv1d's channels: q, k, v of every head
DELTA_REST = (
    Entry("blocks.delta.conv_q_JQC", "JQC", _CONV, "JQ,O,C", fused=_QKV),
    Entry("blocks.delta.conv_k_JQC", "JQC", _CONV, "JQ,O,C", fused=Fused("", _QKV.pieces, 1)),
    Entry("blocks.delta.conv_v_UWC", "UWC", _CONV, "UW,O,C", fused=Fused("", _QKV.pieces, 2)),
    Entry("blocks.delta.a_log_U", "U", LAYER + "linear_attn.A_log", "U"),
    Entry("blocks.delta.dt_bias_U", "U", LAYER + "linear_attn.dt_bias", "U"),
    Entry("blocks.delta.norm_W", "W", LAYER + "linear_attn.norm.weight", "W"),
    Entry("blocks.delta.wo_UWD", "UWD", LAYER + "linear_attn.out_proj.weight", "D,UW"),
)
_PROJ = LAYER + "linear_attn.in_proj_qkv.weight"
DELTA = (
    Entry("blocks.delta.wq_DJQ", "DJQ", _PROJ, "JQ,D", fused=_QKV),
    Entry("blocks.delta.wk_DJQ", "DJQ", _PROJ, "JQ,D", fused=Fused("", _QKV.pieces, 1)),
    Entry("blocks.delta.wv_DUW", "DUW", _PROJ, "UW,D", fused=Fused("", _QKV.pieces, 2)),
    Entry("blocks.delta.wz_DUW", "DUW", LAYER + "linear_attn.in_proj_z.weight", "UW,D"),
    Entry("blocks.delta.wb_DU", "DU", LAYER + "linear_attn.in_proj_b.weight", "U,D"),
    Entry("blocks.delta.wa_DU", "DU", LAYER + "linear_attn.in_proj_a.weight", "U,D"),
    *DELTA_REST,
)


def hybrid_entries(delta=DELTA, mlp=DENSE_MLP) -> tuple[Entry, ...]:
    """The rows of a hybrid: the embedding and norm, the gated attention, the delta-net, the MLP, the output."""
    return (*GATED_ATTENTION, *delta, *MLP_NORM, *mlp, *OUTPUT)


ENTRIES = hybrid_entries()


def hybrid_fields(raw: dict, where, num_layers: int) -> dict:
    """The fields every hybrid family reads: layer kinds, the delta-net's sizes, the gated, partially rotated
    attention with zero-centred norms."""
    types = raw.get("layer_types")
    if types is None:
        interval = integer({"full_attention_interval": raw.get("full_attention_interval", 4)},
                           "full_attention_interval", where)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in HF_KINDS for t in types):
        refuse(where, "layer_types", types, f"expected {num_layers} of {', '.join(HF_KINDS)}")
    kinds = [HF_KINDS[t] for t in types]
    period = next(p for p in range(1, num_layers + 1) if all(kinds[i] == kinds[i % p] for i in range(num_layers)))
    if raw.get("attention_bias"):
        refuse(where, "attention_bias", raw["attention_bias"], "attention biases")
    if raw.get("hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", raw["hidden_act"], "the delta-net's convolution and the MLP use silu")
    if raw.get("sliding_window"):
        refuse(where, "sliding_window", raw["sliding_window"], "sliding windows in a hybrid")
    rope = llama_fields(_without_partial(raw), where)  # the partial factor is read below
    fields = {f: integer(raw, key, where) for f, key in (
        ("linear_num_key_heads", "linear_num_key_heads"), ("linear_num_value_heads", "linear_num_value_heads"),
        ("linear_key_head_dim", "linear_key_head_dim"), ("linear_value_head_dim", "linear_value_head_dim"),
        ("linear_conv_kernel", "linear_conv_kernel_dim"))}
    return {**rope, **fields, "layer_pattern": tuple(kinds[:period]), "qk_norm": True, "norm_plus_one": True,
            "attn_output_gate": True, "partial_rotary_factor": partial_rotary_factor(raw)}


def _without_partial(raw: dict) -> dict:
    """``raw`` with ``partial_rotary_factor`` kept out of the generic RoPE reader's sight (the hybrids read it)."""
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        return {k: v for k, v in raw.items() if k != "partial_rotary_factor"}
    return {**raw, "rope_parameters": {k: v for k, v in params.items() if k != "partial_rotary_factor"}}


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return hybrid_fields(raw, where, num_layers)


def is_hybrid(cfg) -> bool:
    """Whether ``cfg`` has anything only the hybrid families hold (delta-net layers, the output gate, partial RoPE, a
    shared expert)."""
    return bool(cfg.linear_layers or cfg.attn_output_gate or cfg.partial_rotary_factor != 1 or cfg.shared_expert_dim)


def check_hybrid(cfg, architecture: str) -> None:
    """Refuse, in one line, a hybrid that the Qwen3.5 / Qwen3-Next layout cannot hold."""
    need = dict(attn_output_gate=True, qk_norm=True, norm_plus_one=True, qkv_bias=False, post_norms=False,
                o_bias=False, attn_sinks=False, sliding_window=0, mlp_activation="silu", scale_embeddings=False,
                query_pre_attn_scalar=0.0, rope_scaling=None)
    for field, value in need.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"{cfg.name} exports as {architecture}, which needs {field}={value!r}, but it has "
                             f"{getattr(cfg, field)!r}; no Hugging Face architecture here holds it")
    if not cfg.linear_layers:
        raise ValueError(f"{cfg.name} has no delta-net ('linear') layer, which {architecture} has; no Hugging Face "
                         f"architecture here holds its gated attention alone")
    if not cfg.attention_layers:  # the model keeps one attention row, unused, that no tensor of the folder fills
        raise ValueError(f"{cfg.name} has only delta-net ('linear') layers; the {architecture} layout here needs at "
                         f"least one full_attention layer in layer_types (every published model has one in four)")


def claims(cfg, hint) -> bool:
    """A dense hybrid (asked after the vision-language folder's class, before any other family)."""
    if not is_hybrid(cfg) or cfg.num_experts:
        return False
    check_hybrid(cfg, ARCHITECTURE)
    return True


def hybrid_json(cfg, architecture: str, model_type: str, dtype: str) -> dict:
    """The ``config.json`` keys every hybrid family writes."""
    back = {v: k for k, v in HF_KINDS.items()}
    pattern = cfg.layer_pattern
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "layer_types": [back[pattern[i % len(pattern)]] for i in range(cfg.num_layers)],
        "use_cache": True, "dtype": dtype,
    }


def hf_config(cfg, dtype: str) -> dict:
    return {**hybrid_json(cfg, ARCHITECTURE, MODEL_TYPE, dtype), "intermediate_size": cfg.mlp_dim}


# transformers' defaults of the hybrids: theta 1e4 (rope_parameters' default), a quarter of each head rotated,
# full attention every fourth layer, delta-net heads of 128 with a 4-tap convolution
HYBRID = dict(head_dim=256, qk_norm=True, norm_plus_one=True, attn_output_gate=True, partial_rotary_factor=0.25,
              rope_theta=10_000.0, rms_eps=1e-6, layer_pattern=("linear", "linear", "linear", "global"),
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel=4, max_seq_len=32_768)
PRESETS = {
    "qwen3.5-9b": dict(vocab_size=248_320, num_layers=32, hidden=4096, num_heads=16, num_kv_heads=4, mlp_dim=12_288,
                       **HYBRID),
    # the text model of the Hub's Qwen/Qwen3.5-0.8B (its config.json's text_config): the small hybrid the peer
    # benchmark times beside transformers (its 16 value heads, not the default's 32; embeddings tied; theta 1e7)
    "qwen3.5-0.8b": dict(HYBRID, vocab_size=248_320, num_layers=24, hidden=1024, num_heads=8, num_kv_heads=2,
                         mlp_dim=3584, linear_num_value_heads=16, tie_embeddings=True, rope_theta=10_000_000.0,
                         max_seq_len=262_144),
}
