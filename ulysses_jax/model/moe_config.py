"""The expert settings of ``ModelConfig`` (a mixture of experts: ``model/moe.py``) and their checks.

Kept apart from ``moe.py`` so that ``config.py`` can check a model's experts without importing the layers.
"""

from __future__ import annotations

EXPERT_STYLES = ("swiglu", "gpt_oss")  # the experts' MLP: SwiGLU (Qwen3-MoE, Mixtral) or gpt-oss's (model/moe.py)
MOE_IMPLS = ("auto", "pallas", "ragged_dot")  # the experts' grouped matmul (model/moe.py)


def check_experts(cfg) -> None:
    """``ValueError`` naming the field and the fix where ``cfg``'s expert settings (a ``ModelConfig``) do not
    describe a mixture of experts this package models, or describe experts on a dense model."""
    e, k = cfg.num_experts, cfg.experts_per_token
    for field in ("num_experts", "experts_per_token", "moe_mlp_dim", "shared_expert_dim"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{field} ({value!r}) must be 0 or a positive integer")
    if cfg.shared_expert_dim and not e:
        raise ValueError(f"shared_expert_dim ({cfg.shared_expert_dim}) is a shared expert beside routed ones, but "
                         f"num_experts is 0; set num_experts")
    if e == 0:
        if k or cfg.dense_layers or cfg.moe_mlp_dim:
            raise ValueError(f"experts_per_token ({k}), moe_mlp_dim ({cfg.moe_mlp_dim}) and dense_layers "
                             f"({list(cfg.dense_layers)}) describe experts, but num_experts is 0; set num_experts")
        if cfg.moe_impl != "auto":
            raise ValueError(f"moe_impl ({cfg.moe_impl!r}, --moe-impl) chooses the experts' grouped matmul, but "
                             f"{cfg.name} has no experts; drop moe_impl")
        return
    if e < 2:
        raise ValueError(f"num_experts ({e}) must be at least 2 for a mixture of experts (0: a dense MLP)")
    if not 1 <= k <= e:
        raise ValueError(f"experts_per_token ({k}) must be between 1 and num_experts ({e})")
    bad = [i for i in cfg.dense_layers if not isinstance(i, int) or not 0 <= i < cfg.num_layers]
    if bad or len(set(cfg.dense_layers)) != len(cfg.dense_layers):
        raise ValueError(f"dense_layers {list(cfg.dense_layers)} must be distinct layer indices in "
                         f"0..{cfg.num_layers - 1}")
    if len(cfg.dense_layers) == cfg.num_layers:
        raise ValueError(f"dense_layers lists every layer ({cfg.num_layers}); set num_experts 0 for a dense model")
    if cfg.post_norms:
        raise ValueError("experts (num_experts) with post_norms (Gemma 3) are not modelled; drop one")
    if cfg.expert_style not in EXPERT_STYLES:
        raise ValueError(f"expert_style {cfg.expert_style!r} is not one of {', '.join(EXPERT_STYLES)}")
    if cfg.expert_style == "gpt_oss" and (cfg.has_dense_mlp or not cfg.router_renormalize):
        raise ValueError("expert_style 'gpt_oss' has every layer sparse and the top-k weights renormalised (a "
                         "softmax over the top-k logits); drop dense_layers and set router_renormalize")
    if cfg.moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl {cfg.moe_impl!r} is not one of {', '.join(MOE_IMPLS)}")
    if not cfg.router_aux_loss_coef >= 0:
        raise ValueError(f"router_aux_loss_coef ({cfg.router_aux_loss_coef}) must be >= 0")
