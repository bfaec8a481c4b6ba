"""Hugging Face ``config.json`` <-> ``ModelConfig`` fields, the generic part: reading the file, finding its family,
the shape every family has, and the ``config.json`` written on export.

Each family (``model/families/``: Llama, Qwen2, Qwen3, Mistral, Gemma 3, Qwen3-MoE, Mixtral, gpt-oss) reads and
writes its own fields; ``model/families/registry.py`` lists them. Nothing here names one. ``config_fields(path)``
returns plain field values (RoPE scaling as a dict) that ``ModelConfig.from_hf`` turns into a config, and the writer
reads a config's attributes. The weights, which need the model, are ``interop/hf.py``.
"""

from __future__ import annotations

import json
import pathlib

from ulysses_jax.model.families import registry
from ulysses_jax.model.families.fields import refuse, refuse_unmodelled_experts

ARCHITECTURES = {f.ARCHITECTURE: f.MODEL_TYPE for f in registry.FAMILIES}  # config.json "architectures" -> "model_type"
_FAMILY = {f.ARCHITECTURE: f for f in registry.FAMILIES}
# ModelConfig fields that config.json decides (the others, e.g. compute_dtype or remat, are training choices).
HF_CONFIG_FIELDS = ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                    "rope_theta", "rope_scaling", "rms_eps", "tie_embeddings", "qk_norm", "qkv_bias", "sliding_window",
                    "layer_pattern", "rope_local_theta", "post_norms", "norm_plus_one", "mlp_activation",
                    "scale_embeddings", "query_pre_attn_scalar", "num_experts", "experts_per_token", "moe_mlp_dim",
                    "router_renormalize", "dense_layers", "o_bias", "attn_sinks", "expert_style", "swiglu_limit",
                    "swiglu_alpha", "shared_expert_dim", "attn_output_gate", "partial_rotary_factor",
                    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel")


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


def _family(raw: dict, where: pathlib.Path):
    """The family module of a ``config.json``: by its one ``architectures`` entry, else by its ``model_type``."""
    registry.screen(raw, where)
    archs = raw.get("architectures")
    if not archs:
        archs = [a for a, t in ARCHITECTURES.items() if t == raw.get("model_type")]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures {archs!r} (model_type {raw.get('model_type')!r}) is not supported; "
            f"use a model of {', '.join(ARCHITECTURES)}"
        )
    return _FAMILY[archs[0]]


def config_fields(path) -> dict:
    """The ``ModelConfig`` fields of a Hugging Face folder's ``config.json`` (``ModelConfig.from_hf`` builds it): the
    shape every family has, then the family's own fields."""
    folder = pathlib.Path(path).expanduser()
    where = folder / "config.json"
    raw = read_json(where)
    family = _family(raw, where)
    if hasattr(family, "language_config"):  # a vision-language folder's text model, or a family's own defaults
        raw = family.language_config(raw, where)
    raw = {**getattr(family, "HF_DEFAULTS", {}), **raw}  # a key left out: its class's default, as transformers reads
    known = ("full_attention", "sliding_attention", "linear_attention")  # before any family's own rule reads them
    if isinstance(raw.get("layer_types"), list) and (bad := [t for t in raw["layer_types"] if t not in known]):
        raise ValueError(f"{where}: layer_types has {bad[0]!r}, a layer type ulysses_jax does not know; supported: "
                         f"{', '.join(known)}")

    def need(key):
        if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool):
            raise ValueError(f"{where}: {key} = {raw.get(key)!r} must be a positive integer; fix config.json")
        return raw[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    layers, head_dim = need("num_hidden_layers"), raw.get("head_dim") or hidden // heads
    fields = dict(
        name=folder.resolve().name or family.MODEL_TYPE,
        vocab_size=need("vocab_size"), num_layers=layers, hidden=hidden, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim, mlp_dim=need("intermediate_size"),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    if raw.get("mlp_bias"):
        refuse(where, "mlp_bias", raw["mlp_bias"], "the MLP has no biases")
    refuse_unmodelled_experts(raw, where, getattr(family, "MODELLED_EXPERT_KEYS", ()))
    fields.update(family.fields(raw, where, layers, head_dim))
    if isinstance(raw.get("max_position_embeddings"), int):
        fields["max_seq_len"] = raw["max_position_embeddings"]
    return fields


def export_family(cfg, hint=None):
    """The family module that writes ``cfg``: the first of ``registry.EXPORT_ORDER`` that claims it (``hint``: the
    source folder's ``architectures``, which tells Mistral from Llama); ``ValueError`` where none can hold it."""
    for family in registry.EXPORT_ORDER:
        if family.claims(cfg, hint):
            return family
    raise ValueError(f"no Hugging Face architecture here holds the model {cfg.name!r}")


def export_architecture(cfg, hint=None) -> str:
    """The HF class that holds ``cfg`` (``export_family``)."""
    return export_family(cfg, hint).ARCHITECTURE


def hf_config(cfg, arch: str, dtype: str, source: dict | None = None) -> dict:
    """The ``config.json`` of ``cfg`` as ``arch``; token ids are taken from ``source`` (the original config.json)."""
    family = _FAMILY[arch]
    out = family.hf_config(cfg, dtype)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if (source or {}).get(key) is not None:
            out[key] = source[key]
    if hasattr(family, "wrap_config"):  # a vision-language class: the text model inside the source's own config
        out = family.wrap_config(out, source or {})
    return out
