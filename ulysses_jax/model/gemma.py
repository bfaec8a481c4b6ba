"""Gemma 3 (text) ``config.json`` <-> ``ModelConfig`` fields, and the sliding-window layer types of any family.

Gemma 3 differs from the Llama family in ways ``ModelConfig`` names (``model/transformer.py`` implements them): norms
before *and* after both sublayers (``post_norms``), norm scales stored as ``w`` and applied as ``1 + w``
(``norm_plus_one``), per-head q/k norms, a gated MLP with the tanh GELU (``mlp_activation="gelu_tanh"``), embeddings
times ``sqrt(hidden)``, the attention scale ``query_pre_attn_scalar ** -0.5``, five local layers (a sliding window)
to one global one, local layers with their own RoPE base and global ones with a linear scaling, tied embeddings.
Read from transformers 5's ``rope_parameters`` (per layer type) or 4's ``rope_theta`` + ``rope_local_base_freq`` +
``rope_scaling``; written in the latter layout, which both read. Imports nothing of the package (as ``hf_config``).
"""

from __future__ import annotations

HF_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}


def _refuse(where, field, value, why):
    raise ValueError(f"{where}: {field} = {value!r} is not supported ({why}); only models without it can be imported")


def layer_fields(raw: dict, where, num_layers: int, window_default: int | None, derived: list[str] | None) -> dict:
    """``sliding_window`` and ``layer_pattern`` from ``layer_types`` (or ``derived``, a family's rule, when the file
    has none): the shortest pattern that repeats to the list; refuses a type we do not know."""
    types = raw.get("layer_types") or derived or ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        _refuse(where, "layer_types", types, f"expected a list of {num_layers} layer types")
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
    pattern = cfg.layer_pattern or (("local",) if cfg.sliding_window else ("global",))
    back = {v: k for k, v in HF_LAYER_TYPES.items()}
    return [back[pattern[i % len(pattern)]] for i in range(cfg.num_layers)]


def _gemma_rope(raw: dict, where) -> dict:
    params = raw.get("rope_parameters")
    if params is not None:  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        if not isinstance(params, dict) or not {"full_attention", "sliding_attention"} <= set(params):
            _refuse(where, "rope_parameters", params, "expected one entry per layer type")
        full, local = params["full_attention"], params["sliding_attention"]
    else:
        full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        _refuse(where, "sliding_attention rope_type", local["rope_type"], "local layers take plain RoPE")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        _refuse(where, "full_attention rope_type", kind, "Gemma 3's global layers take 'default' or 'linear' RoPE")
    scaling = dict(rope_type="linear", factor=float(full["factor"])) if kind == "linear" else None
    return dict(rope_theta=float(full["rope_theta"]), rope_local_theta=float(local["rope_theta"]),
                rope_scaling=scaling)


def gemma_fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    """The Gemma-3-specific ``ModelConfig`` fields of a ``Gemma3ForCausalLM`` config.json (others: ``hf_config``)."""
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        _refuse(where, "hidden_activation", act, "Gemma 3's MLP is GeGLU with the tanh GELU")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(field) is not None:
            _refuse(where, field, raw[field], "logit soft-capping (Gemma 2)")
    if raw.get("use_bidirectional_attention"):
        _refuse(where, "use_bidirectional_attention", True, "EmbeddingGemma's bidirectional attention")
    if raw.get("attention_bias"):
        _refuse(where, "attention_bias", True, "attention biases")
    pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
    derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return dict(**_gemma_rope(raw, where), **layer_fields(raw, where, num_layers, 4096, derived),
                post_norms=True, norm_plus_one=True, mlp_activation="gelu_tanh", scale_embeddings=True,
                qk_norm=True, qkv_bias=False, query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", head_dim)),
                tie_embeddings=bool(raw.get("tie_word_embeddings", True)))


def check_gemma_exportable(cfg) -> None:
    """Gemma 3's architecture holds a model with every Gemma-3 switch on; refuse a mix with the Llama family's."""
    need = dict(post_norms=True, norm_plus_one=True, mlp_activation="gelu_tanh", scale_embeddings=True, qk_norm=True,
                qkv_bias=False)
    for field, value in need.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"a model with post_norms is exported as Gemma3ForCausalLM, which needs "
                             f"{field}={value!r}, but this one has {getattr(cfg, field)!r}; no Hugging Face "
                             f"architecture here holds it")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "linear":
        raise ValueError(f"Gemma3ForCausalLM scales RoPE linearly; this model has {cfg.rope_scaling.rope_type!r}")


def _int_if_whole(x: float):
    return int(x) if float(x).is_integer() else float(x)


def gemma_hf_config(cfg, dtype: str) -> dict:
    """The ``config.json`` entries of a Gemma 3 text model (transformers 4's layout, which 5 converts)."""
    check_gemma_exportable(cfg)
    sc = cfg.rope_scaling
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
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
