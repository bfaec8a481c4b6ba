"""What the families share in reading and writing ``config.json``: refusals, layer types, RoPE, experts, the keys of the
Llama layout.

Plain values in, plain values out: a family's ``fields`` returns ``ModelConfig`` field values (RoPE scaling as a dict,
which ``ModelConfig.from_hf`` turns into ``RopeScaling``), and the writers read a config's attributes. Nothing here
names an architecture: that is the family modules' (``model/families/registry.py`` lists them).
"""

from __future__ import annotations

from ulysses_jax.model.layer_kinds import layer_types

HF_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}
# keys of MoE variants that are not modelled: shared experts (Qwen2-MoE, DeepSeek), DeepSeek-style layers and routing
UNMODELLED_EXPERT_KEYS = {
    "shared_expert_intermediate_size": "a shared expert beside the routed ones",
    "n_shared_experts": "shared experts beside the routed ones",
    "first_k_dense_replace": "DeepSeek-style dense first layers",
    "n_routed_experts": "DeepSeek-style routed experts",
    "topk_group": "group-limited routing",
    "n_group": "group-limited routing",
    "routed_scaling_factor": "scaled routing weights",
    "moe_layer_freq": "DeepSeek-style sparse-layer frequency",
}


def refuse(where, field, value, why):
    raise ValueError(f"{where}: {field} = {value!r} is not supported ({why}); only models without it can be imported")


def integer(raw: dict, key: str, where, minimum: int = 1) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}: {key} = {value!r} must be an integer >= {minimum}; fix config.json")
    return value


# ----------------------------------------------------------------------------------------------
# layer types: sliding windows


def layer_fields(raw: dict, where, num_layers: int, window_default: int | None, derived: list[str] | None) -> dict:
    """``sliding_window`` and ``layer_pattern`` from ``layer_types`` (or ``derived``, a family's rule, when the file
    has none): the shortest pattern that repeats to the list; refuses a type we do not know."""
    types = raw.get("layer_types") or derived or ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        refuse(where, "layer_types", types, f"expected a list of {num_layers} layer types")
    for t in types:
        if t not in HF_LAYER_TYPES:
            raise ValueError(f"{where}: layer_types has {t!r}, a layer type ulysses_jax does not know; supported: "
                             f"{', '.join(HF_LAYER_TYPES)}")
    kinds = [HF_LAYER_TYPES[t] for t in types]
    if "local" not in kinds:
        return dict(sliding_window=0, layer_pattern=())
    window = raw.get("sliding_window", window_default)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{where}: sliding_window = {window!r} must be a positive number of tokens for the "
                         f"sliding_attention layers; fix config.json")
    if "global" not in kinds:
        return dict(sliding_window=window, layer_pattern=())
    period = next(p for p in range(1, num_layers + 1) if all(kinds[i] == kinds[i % p] for i in range(num_layers)))
    return dict(sliding_window=window, layer_pattern=tuple(kinds[:period]))


def hf_layer_types(cfg) -> list[str]:
    """Per layer, the Hugging Face layer type (``sliding_attention`` / ``full_attention``)."""
    back = {v: k for k, v in HF_LAYER_TYPES.items()}
    return [back[t] for t in layer_types(cfg)]


# ----------------------------------------------------------------------------------------------
# RoPE


def rope(raw: dict, where, partial: bool = False) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` (scaling: ``RopeScaling``'s fields) from transformers 5's ``rope_parameters`` or
    4's ``rope_theta`` + ``rope_scaling``. ``partial``: the family reads ``partial_rotary_factor`` itself
    (``partial_rotary_factor``), else any other value than 1 is refused."""
    if raw.get("rope_parameters") is not None:
        field, params = "rope_parameters", raw["rope_parameters"]
        if not isinstance(params, dict) or "rope_theta" not in params:
            refuse(where, field, params, "expected one {rope_theta, rope_type, ...} for every layer")
        theta = params["rope_theta"]
    else:
        field, params = "rope_scaling", raw.get("rope_scaling") or {}
        theta = raw.get("rope_theta", 10_000.0)
        if not isinstance(params, dict):
            refuse(where, field, params, "expected an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    if partial_rotary_factor(raw) != 1.0 and not partial:
        refuse(where, "partial_rotary_factor", partial_rotary_factor(raw), "RoPE on part of the head dimension")
    if kind == "default":
        return float(theta), None
    if kind == "yarn":
        return float(theta), _yarn(params, raw, where, field)
    if kind != "llama3":
        refuse(where, f"{field}.rope_type", kind, "only 'default', 'llama3' and 'yarn' RoPE are modelled")
    try:
        scaling = dict(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_position=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{where}: {field} of rope_type 'llama3' has no {e.args[0]!r}; add it") from None
    return float(theta), scaling


def partial_rotary_factor(raw: dict) -> float:
    """The share of each head's dims that RoPE rotates (``rope_parameters`` of transformers 5, or the top level)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))


def _yarn(params: dict, raw: dict, where, field: str) -> dict:
    """``RopeScaling``'s fields of a YaRN ``rope_type`` (transformers' defaults: betas 32 / 1, truncate True, the
    attention factor from ``factor``; ``mscale`` variants refused)."""
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            refuse(where, f"{field}.{key}", params[key], "YaRN's DeepSeek-style mscale")
    try:
        factor = float(params["factor"])
        original = int(params.get("original_max_position_embeddings") or raw["max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"{where}: {field} of rope_type 'yarn' has no {e.args[0]!r}; add it") from None
    return dict(rope_type="yarn", factor=factor, original_max_position=original,
                beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
                attention_factor=float(params.get("attention_factor") or 0))


def rope_scaling_json(sc) -> dict | None:
    """``rope_scaling`` of ``config.json`` for a ``RopeScaling`` of type ``llama3`` or ``yarn`` (or ``None``)."""
    if sc is None:
        return None
    if sc.rope_type == "yarn":
        out = {"rope_type": "yarn", "factor": sc.factor, "beta_fast": sc.beta_fast, "beta_slow": sc.beta_slow,
               "truncate": sc.truncate, "original_max_position_embeddings": sc.original_max_position}
        return {**out, "attention_factor": sc.attention_factor} if sc.attention_factor else out
    return {"rope_type": "llama3", "factor": sc.factor, "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor, "original_max_position_embeddings": sc.original_max_position}


# ----------------------------------------------------------------------------------------------
# the Llama layout: SwiGLU with silu, one RoPE for every layer


def llama_fields(raw: dict, where, attention_bias: bool = False) -> dict:
    """The SwiGLU MLP (``hidden_act`` silu), attention biases refused (unless the family has them) and RoPE."""
    if raw.get("hidden_act", "silu") != "silu":
        refuse(where, "hidden_act", raw["hidden_act"], "the MLP is SwiGLU with silu")
    if not attention_bias and raw.get("attention_bias"):
        refuse(where, "attention_bias", raw["attention_bias"], "attention biases, o_proj's among them")
    theta, scaling = rope(raw, where)
    return dict(rope_theta=theta, rope_scaling=scaling)


def llama_json(cfg, architecture: str, model_type: str, dtype: str) -> dict:
    """The ``config.json`` keys of the Llama layout (a family adds its own after them)."""
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling_json(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------------------------
# mixtures of experts


def refuse_unmodelled_experts(raw: dict, where, modelled: tuple[str, ...] = ()) -> None:
    """Refuse the keys of the MoE variants that the family does not model (``modelled``: the keys it reads)."""
    for key, what in UNMODELLED_EXPERT_KEYS.items():
        if key in modelled:
            continue
        value = raw.get(key)
        if value not in (None, 0, [], False) and not (key == "routed_scaling_factor" and value == 1):
            raise ValueError(f"{where}: {key} = {raw[key]!r} is not supported ({what}); ulysses_jax models the "
                             f"routed experts of Qwen3-MoE, Mixtral and gpt-oss, and the shared expert of Qwen3-Next "
                             f"and Qwen3.5-MoE only")


def expert_fields(raw: dict, where, experts_key: str) -> dict:
    """The routed experts every MoE family has: their count (``experts_key``), ``num_experts_per_tok`` and
    ``router_aux_loss_coef``."""
    experts = integer(raw, experts_key, where, 2)
    top_k = integer(raw, "num_experts_per_tok", where)
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok = {top_k} is larger than {experts_key} = {experts}; each token "
                         f"picks that many experts of those there are: fix config.json")
    coef = raw.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        raise ValueError(f"{where}: router_aux_loss_coef = {coef!r} must be a number >= 0; fix config.json")
    return dict(num_experts=experts, experts_per_token=top_k, router_aux_loss_coef=float(coef))


def expert_json(cfg) -> dict:
    """The ``config.json`` keys of the routed experts that every MoE family writes (before its own)."""
    return {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": False}


def refuse_gpt_oss_attention(cfg) -> None:
    """A mixture of experts other than gpt-oss's has neither output-projection biases nor attention sinks."""
    if cfg.o_bias or cfg.attn_sinks:
        raise ValueError("output-projection biases and attention sinks export with gpt-oss experts only")
