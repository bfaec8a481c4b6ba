"""Hugging Face ``config.json`` <-> ``ModelConfig`` fields: the families read (Llama 3.x, Qwen2, Qwen3, Mistral, with
their sliding windows, and Gemma 3 text: ``model/gemma.py``), the settings refused with the field that asks for them,
and the ``config.json`` written on export. This module imports nothing of the package but ``model/gemma.py``:
``config_fields(path)`` returns plain field values (RoPE scaling as a dict) that ``ModelConfig.from_hf`` turns into a
config, and the writer reads a config's attributes. The weights, which need the model, are ``interop/hf.py``.
"""

from __future__ import annotations

import json
import pathlib

from ulysses_jax.model.gemma import gemma_fields, gemma_hf_config, hf_layer_types, layer_fields
from ulysses_jax.model.hf_moe import moe_architecture, moe_fields, moe_hf_config

ARCHITECTURES = {  # config.json "architectures" -> "model_type"
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# ModelConfig fields that config.json decides (the others, e.g. compute_dtype or remat, are training choices).
HF_CONFIG_FIELDS = ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                    "rope_theta", "rope_scaling", "rms_eps", "tie_embeddings", "qk_norm", "qkv_bias", "sliding_window",
                    "layer_pattern", "rope_local_theta", "post_norms", "norm_plus_one", "mlp_activation",
                    "scale_embeddings", "query_pre_attn_scalar", "num_experts", "experts_per_token", "moe_mlp_dim",
                    "router_renormalize", "dense_layers", "o_bias", "attn_sinks", "expert_style", "swiglu_limit",
                    "swiglu_alpha")


def read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; pass a Hugging Face model folder (with config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); restore the file from the model's source") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _architecture(raw: dict, where: pathlib.Path) -> str:
    if raw.get("model_type") == "gemma3" or "vision_config" in raw or raw.get("architectures") == [
            "Gemma3ForConditionalGeneration"]:
        raise ValueError(f"{where} is a Gemma 3 vision-language model (text_config + vision_config); ulysses_jax "
                         f"takes Gemma 3 text only and would ignore the vision tower: use a Gemma3ForCausalLM folder "
                         f"(model_type 'gemma3_text', e.g. gemma-3-1b)")
    archs = raw.get("architectures")
    if not archs:
        archs = [a for a, t in ARCHITECTURES.items() if t == raw.get("model_type")]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures {archs!r} (model_type {raw.get('model_type')!r}) is not supported; "
            f"use a model of {', '.join(ARCHITECTURES)}"
        )
    return archs[0]


def _refuse(where, field, value, why):
    raise ValueError(f"{where}: {field} = {value!r} is not supported ({why}); only models without it can be imported")


def _rope(raw: dict, where) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` (scaling: ``RopeScaling``'s fields) from transformers 5's ``rope_parameters`` or
    4's ``rope_theta`` + ``rope_scaling``."""
    if raw.get("rope_parameters") is not None:
        field, params = "rope_parameters", raw["rope_parameters"]
        if not isinstance(params, dict) or "rope_theta" not in params:
            _refuse(where, field, params, "expected one {rope_theta, rope_type, ...} for every layer")
        theta = params["rope_theta"]
    else:
        field, params = "rope_scaling", raw.get("rope_scaling") or {}
        theta = raw.get("rope_theta", 10_000.0)
        if not isinstance(params, dict):
            _refuse(where, field, params, "expected an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse(where, "partial_rotary_factor", partial, "RoPE on part of the head dimension")
    if kind == "default":
        return float(theta), None
    if kind == "yarn":
        return float(theta), _yarn(params, raw, where, field)
    if kind != "llama3":
        _refuse(where, f"{field}.rope_type", kind, "only 'default', 'llama3' and 'yarn' RoPE are modelled")
    try:
        scaling = dict(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_position=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{where}: {field} of rope_type 'llama3' has no {e.args[0]!r}; add it") from None
    return float(theta), scaling


def _yarn(params: dict, raw: dict, where, field: str) -> dict:
    """``RopeScaling``'s fields of a YaRN ``rope_type`` (transformers' defaults: betas 32 / 1, truncate True, the
    attention factor from ``factor``; ``mscale`` variants refused)."""
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            _refuse(where, f"{field}.{key}", params[key], "YaRN's DeepSeek-style mscale")
    try:
        factor = float(params["factor"])
        original = int(params.get("original_max_position_embeddings") or raw["max_position_embeddings"] / factor)
    except KeyError as e:
        raise ValueError(f"{where}: {field} of rope_type 'yarn' has no {e.args[0]!r}; add it") from None
    return dict(rope_type="yarn", factor=factor, original_max_position=original,
                beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
                attention_factor=float(params.get("attention_factor") or 0))


def config_fields(path) -> dict:
    """The ``ModelConfig`` fields of a Hugging Face folder's ``config.json`` (``ModelConfig.from_hf`` builds it)."""
    folder = pathlib.Path(path).expanduser()
    where = folder / "config.json"
    raw = read_json(where)
    arch = _architecture(raw, where)

    def need(key):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool):
            raise ValueError(f"{where}: {key} = {raw.get(key)!r} must be a positive integer; fix config.json")
        return raw[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    layers, head_dim = need("num_hidden_layers"), raw.get("head_dim") or hidden // heads
    if arch == "Gemma3ForCausalLM":
        extra = gemma_fields(raw, where, layers, head_dim)
    else:
        extra = _window_fields(raw, where, arch, layers)
    if arch != "Gemma3ForCausalLM" and raw.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", raw["hidden_act"], "the MLP is SwiGLU with silu")
    if raw.get("mlp_bias"):
        _refuse(where, "mlp_bias", raw["mlp_bias"], "the MLP has no biases")
    if arch not in ("Qwen2ForCausalLM", "GptOssForCausalLM") and raw.get("attention_bias"):
        _refuse(where, "attention_bias", raw["attention_bias"], "attention biases, o_proj's among them")
    theta, scaling = _rope(raw, where) if arch != "Gemma3ForCausalLM" else (None, None)
    fields = dict(
        name=folder.resolve().name or ARCHITECTURES[arch],
        vocab_size=need("vocab_size"), num_layers=layers, hidden=hidden, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        mlp_dim=need("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=arch in _QWEN3, qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
    )
    fields.update(extra)
    fields.update(moe_fields(raw, where, arch, layers))
    if isinstance(raw.get("max_position_embeddings"), int):
        fields["max_seq_len"] = raw["max_position_embeddings"]
    return fields



def _window_fields(raw: dict, where, arch: str, layers: int) -> dict:
    """Sliding windows of the Llama-family configs: Mistral's ``sliding_window`` (every layer; transformers' default
    4096 when absent), Qwen2/Qwen3's ``use_sliding_window`` from layer ``max_window_layers`` on (or ``layer_types``)."""
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # transformers' defaults: Mistral 4096, Mixtral none
        window = raw.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
        derived = ["full_attention" if window is None else "sliding_attention"] * layers
        return layer_fields({**raw, "layer_types": None}, where, layers, 4096, derived)
    if arch in ("Qwen2ForCausalLM", *_QWEN3):
        if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
            return layer_fields({**raw, "layer_types": None}, where, layers, None, None)
        start = raw.get("max_window_layers", 28)
        derived = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        return layer_fields(raw, where, layers, None, derived)
    if arch == "GptOssForCausalLM":  # transformers' default: sliding layers 0, 2, 4, ..., full ones between
        derived = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        return layer_fields(raw, where, layers, 128, derived)
    if any(t != "full_attention" for t in raw.get("layer_types") or ()):
        _refuse(where, "layer_types", sorted(set(raw["layer_types"])), "Llama has no sliding-window layers")
    return {}


def export_architecture(cfg, hint=None) -> str:
    """The HF class that holds ``cfg``: Gemma 3 (post norms), Qwen3 (q/k norm), Qwen2 (q/k/v bias), Mistral
    (``hint``, name, or a window on every layer), Llama."""
    if cfg.post_norms:
        return "Gemma3ForCausalLM"
    if cfg.num_experts:
        return moe_architecture(cfg)
    mixed = cfg.sliding_window and "global" in (cfg.layer_pattern or ("local",))
    if mixed and not (cfg.qk_norm or cfg.qkv_bias):
        raise ValueError("a model mixing local and global layers without q/k/v bias or qk-norm has no Hugging Face "
                         "architecture here (Mistral windows every layer); use one kind of layer, or export as Qwen")
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("a model with both qk_norm and qkv_bias has no Hugging Face architecture here; drop one")
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM"
    if hint == ["MistralForCausalLM"] or cfg.name.lower().startswith("mistral") or cfg.sliding_window:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def hf_config(cfg, arch: str, dtype: str, source: dict | None = None) -> dict:
    """The ``config.json`` of ``cfg`` as ``arch``; token ids are taken from ``source`` (the original config.json)."""
    if arch == "Gemma3ForCausalLM":
        return _token_ids(gemma_hf_config(cfg, dtype), source)
    sc = cfg.rope_scaling
    out = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(sc),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
    }
    if arch in ("LlamaForCausalLM", *_QWEN3):
        out["attention_bias"] = False
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = False
    if arch in ("Qwen2ForCausalLM", *_QWEN3):
        out["use_sliding_window"] = bool(cfg.sliding_window)
        if cfg.sliding_window:
            types = hf_layer_types(cfg)
            out["layer_types"] = types
            out["max_window_layers"] = types.index("sliding_attention")
    if arch == "GptOssForCausalLM":
        out.update(attention_bias=True, layer_types=hf_layer_types(cfg))
    if arch != "LlamaForCausalLM":
        out["sliding_window"] = cfg.sliding_window or None
    if cfg.num_experts:
        out.update(moe_hf_config(cfg, arch))
    return _token_ids(out, source)


def _rope_scaling(sc) -> dict | None:
    if sc is None:
        return None
    if sc.rope_type == "yarn":
        out = {"rope_type": "yarn", "factor": sc.factor, "beta_fast": sc.beta_fast, "beta_slow": sc.beta_slow,
               "truncate": sc.truncate, "original_max_position_embeddings": sc.original_max_position}
        return {**out, "attention_factor": sc.attention_factor} if sc.attention_factor else out
    return {"rope_type": "llama3", "factor": sc.factor, "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor, "original_max_position_embeddings": sc.original_max_position}


def _token_ids(out: dict, source: dict | None) -> dict:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if (source or {}).get(key) is not None:
            out[key] = source[key]
    return out
