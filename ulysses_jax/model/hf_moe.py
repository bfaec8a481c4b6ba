"""Mixture-of-experts ``config.json`` <-> ``ModelConfig`` fields: Qwen3-MoE (``Qwen3MoeForCausalLM``) and Mixtral
(``MixtralForCausalLM``), and the variants refused with the key that asks for them. Imports nothing of the package (as
``hf_config``, which calls it).

Qwen3-MoE: ``num_experts`` (transformers 5 writes ``num_local_experts``), ``num_experts_per_tok``,
``moe_intermediate_size`` (an expert's width; ``intermediate_size`` is the dense layers'), ``norm_topk_prob``, and a
layer is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``. Mixtral:
``num_local_experts``, ``num_experts_per_tok``, experts of ``intermediate_size``, the top-k always renormalised, every
layer sparse. Both: ``router_aux_loss_coef``.
"""

from __future__ import annotations

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
# keys of MoE variants that are not modelled: shared experts (Qwen2-MoE, DeepSeek), DeepSeek-style layers and routing
_REFUSED_KEYS = {
    "shared_expert_intermediate_size": "a shared expert beside the routed ones",
    "n_shared_experts": "shared experts beside the routed ones",
    "first_k_dense_replace": "DeepSeek-style dense first layers",
    "n_routed_experts": "DeepSeek-style routed experts",
    "topk_group": "group-limited routing",
    "n_group": "group-limited routing",
    "routed_scaling_factor": "scaled routing weights",
    "moe_layer_freq": "DeepSeek-style sparse-layer frequency",
}


def _int(raw, key, where, minimum=1):
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}: {key} = {value!r} must be an integer >= {minimum}; fix config.json")
    return value


def moe_fields(raw: dict, where, arch: str, num_layers: int) -> dict:
    """The ``ModelConfig`` expert fields of a MoE ``config.json`` (an empty dict for the dense architectures)."""
    for key, what in _REFUSED_KEYS.items():
        value = raw.get(key)
        if value not in (None, 0, [], False) and not (key == "routed_scaling_factor" and value == 1):
            raise ValueError(f"{where}: {key} = {raw[key]!r} is not supported ({what}); ulysses_jax models the "
                             f"routed experts of Qwen3-MoE and Mixtral only")
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts_key = "num_experts" if arch == "Qwen3MoeForCausalLM" and "num_experts" in raw else "num_local_experts"
    experts = _int(raw, experts_key, where, 2)
    top_k = _int(raw, "num_experts_per_tok", where)
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok = {top_k} is larger than {experts_key} = {experts}; each token "
                         f"picks that many experts of those there are: fix config.json")
    coef = raw.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        raise ValueError(f"{where}: router_aux_loss_coef = {coef!r} must be a number >= 0; fix config.json")
    fields = dict(num_experts=experts, experts_per_token=top_k, router_aux_loss_coef=float(coef))
    if arch == "GptOssForCausalLM":
        return {**fields, **_gpt_oss_fields(raw, where)}
    if arch == "MixtralForCausalLM":
        if raw.get("router_jitter_noise"):
            raise ValueError(f"{where}: router_jitter_noise = {raw['router_jitter_noise']!r} is not supported (noise "
                             f"on the router's input in training); set it to 0")
        return {**fields, "router_renormalize": True}
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step = {step!r} must be a positive integer; fix config.json")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in only):
        raise ValueError(f"{where}: mlp_only_layers = {only!r} must list layer indices in 0..{num_layers - 1}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if len(dense) == num_layers:
        raise ValueError(f"{where}: mlp_only_layers / decoder_sparse_step leave no sparse layer; this is a dense "
                         f"model: use a Qwen3ForCausalLM folder")
    return {**fields, "moe_mlp_dim": _int(raw, "moe_intermediate_size", where), "dense_layers": dense,
            "router_renormalize": bool(raw.get("norm_topk_prob", False))}


def _gpt_oss_fields(raw: dict, where) -> dict:
    """gpt-oss: biases on q, k, v and o (``attention_bias``), attention sinks, its experts (``expert_style``); the
    Hub's MXFP4 expert weights are dequantised on import (``interop/mxfp4.py``), other quantisations refused."""
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, "mxfp4"):
        raise ValueError(f"{where}: quantization_config.quant_method = {method!r} is not supported (ulysses_jax "
                         f"dequantises gpt-oss's MXFP4 expert weights only); use the original or a bfloat16 folder")
    if not raw.get("attention_bias", True):
        raise ValueError(f"{where}: attention_bias = false is not modelled for gpt-oss (its q, k, v and o have biases)")
    return dict(o_bias=True, attn_sinks=True, expert_style="gpt_oss", router_renormalize=True,
                swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))


def moe_architecture(cfg) -> str:
    """The HF class of a model with experts: gpt-oss by its experts, Qwen3-MoE with qk-norm, Mixtral without
    (refusing what none holds)."""
    if cfg.expert_style == "gpt_oss":
        if not (cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks) or cfg.qk_norm:
            raise ValueError("gpt-oss experts export as GptOssForCausalLM, which has q/k/v/o biases and attention "
                             "sinks and no qk-norm; this model differs")
        return "GptOssForCausalLM"
    if cfg.o_bias or cfg.attn_sinks:
        raise ValueError("output-projection biases and attention sinks export with gpt-oss experts only")
    if cfg.qk_norm and not cfg.qkv_bias:
        return "Qwen3MoeForCausalLM"
    if cfg.qkv_bias or cfg.dense_layers or not cfg.router_renormalize or cfg.expert_mlp_dim != cfg.mlp_dim:
        raise ValueError("a mixture of experts without qk-norm exports as Mixtral, which has no q/k/v bias, no dense "
                         "layers, experts as wide as mlp_dim and renormalised top-k weights; this model differs")
    return "MixtralForCausalLM"


def moe_hf_config(cfg, arch: str) -> dict:
    """The expert keys of ``config.json`` for ``arch`` (added to the family's own keys)."""
    out = {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
           "output_router_logits": False}
    if arch == "MixtralForCausalLM":
        return {**out, "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0}
    if arch == "GptOssForCausalLM":
        return {**out, "num_local_experts": cfg.num_experts, "swiglu_limit": cfg.swiglu_limit,
                "swiglu_alpha": cfg.swiglu_alpha}
    return {**out, "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_mlp_dim,
            "norm_topk_prob": cfg.router_renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers)}
