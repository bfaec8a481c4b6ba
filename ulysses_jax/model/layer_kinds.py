"""Per-layer token mixers: which layers are global (full causal attention), local (a sliding window) or linear (the
gated delta-net of Qwen3.5 / Qwen3-Next), checked.

``ModelConfig.layer_pattern`` is repeated over the layers and cut at ``num_layers`` (Gemma 3: five "local" then one
"global", 26 or 34 layers; Qwen3.5: three "linear" then one "global"); a pattern as long as the model lists every
layer (Qwen2's ``max_window_layers``). An empty pattern means every layer "local" when ``sliding_window > 0``, else
every layer "global". The transformer scans its stacked layers once whatever the pattern: each layer's kind index is
scanned with its parameters and a ``lax.switch`` picks the sublayer of that kind (``model/transformer.py``). An
attention kind is the window (``None``: global), indexed by ``kinds``; the linear layers, if any, take the index after
the attention kinds (``kind_index``); a hybrid's two token mixers are each stacked over their own layers
(``mixer_layers``; ``stack_rows``: the row a layer reads). The local layers also take their own RoPE base
(``rope_local_theta``). This module
reads a config's attributes and imports nothing of the package (``model/config.py`` calls it).
"""

from __future__ import annotations

from ulysses_jax.kernels.gated_delta import IMPLS, PRECISIONS

LAYER_TYPES = ("global", "local", "linear")
LINEAR_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def check_layers(cfg) -> None:
    """Raise ``ValueError`` naming the field for a bad window, pattern or Gemma-3 setting."""
    window = cfg.sliding_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"sliding_window ({window!r}) must be 0 (no local layers) or a positive number of tokens")
    pattern = cfg.layer_pattern
    if not isinstance(pattern, tuple):
        raise ValueError(f"layer_pattern ({pattern!r}) must be a tuple of 'global' / 'local' / 'linear'")
    for kind in pattern:
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_pattern has {kind!r}, an unknown layer type; use 'global', 'local' or 'linear'")
    if "local" in pattern and not window:
        raise ValueError("layer_pattern has 'local' layers but sliding_window is 0; set sliding_window (tokens)")
    if len(pattern) > cfg.num_layers:
        raise ValueError(f"layer_pattern has {len(pattern)} entries for {cfg.num_layers} layers; give at most one "
                         f"per layer")
    if cfg.rope_local_theta and cfg.rope_local_theta <= 1:
        raise ValueError(f"rope_local_theta ({cfg.rope_local_theta}) must be > 1, or 0 for the global base")
    if cfg.mlp_activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"mlp_activation {cfg.mlp_activation!r} is not one of 'silu', 'gelu_tanh'")
    if cfg.query_pre_attn_scalar < 0:
        raise ValueError(f"query_pre_attn_scalar ({cfg.query_pre_attn_scalar}) must be positive, or 0 for head_dim")
    if cfg.post_norms and cfg.attn_recompute:
        raise ValueError("attn_recompute keeps no attention output, which the backward of the post-attention norm "
                         "(post_norms, Gemma 3) reads; set attn_recompute to False")
    check_linear(cfg)


def check_linear(cfg) -> None:
    """The delta-net layers' sizes (``linear_*``) are given exactly when ``layer_pattern`` has ``"linear"`` layers."""
    sizes = {f: getattr(cfg, f) for f in LINEAR_SIZES}
    for field, value in (*sizes.items(), ("linear_conv_kernel", cfg.linear_conv_kernel)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{field} ({value!r}) must be a positive integer (0: no delta-net layers)")
    linear = "linear" in cfg.layer_pattern
    if cfg.delta_precision not in PRECISIONS:
        raise ValueError(f"delta_precision {cfg.delta_precision!r} is not one of {', '.join(PRECISIONS)}: the delta "
                         f"rule's chunk products in float32 at HIGHEST precision, or on bfloat16 operands")
    if cfg.delta_impl not in IMPLS:
        raise ValueError(f"delta_impl {cfg.delta_impl!r} is not one of {', '.join(IMPLS)}: the delta rule's walk over "
                         f"chunks as a lax.scan of XLA ops, or as Pallas kernels")
    if not linear:
        if cfg.delta_impl != "xla":
            raise ValueError(f"delta_impl ({cfg.delta_impl!r}) sets the delta rule of delta-net layers, but "
                             f"{cfg.name} has none; leave it at 'xla'")
        if any(sizes.values()):
            raise ValueError(f"{', '.join(f for f, v in sizes.items() if v)} describe delta-net layers, but "
                             f"layer_pattern {list(cfg.layer_pattern)} has no 'linear' layer; add one or set them to 0")
        if cfg.delta_head_chunk:
            raise ValueError(f"delta_head_chunk ({cfg.delta_head_chunk}) groups the heads of delta-net layers, but "
                             f"{cfg.name} has none; set it to 0")
        if cfg.delta_precision != "highest":
            raise ValueError(f"delta_precision ({cfg.delta_precision!r}) sets the delta rule of delta-net layers, but "
                             f"{cfg.name} has none; leave it at 'highest'")
        return
    if missing := [f for f, v in sizes.items() if not v]:
        raise ValueError(f"layer_pattern has 'linear' (delta-net) layers; set {', '.join(missing)}")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hv % hk:
        raise ValueError(f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk}): each key "
                         f"head serves an equal share of the value heads")
    if cfg.linear_conv_kernel < 1:
        raise ValueError(f"linear_conv_kernel ({cfg.linear_conv_kernel}) must be >= 1 (Qwen3.5 and Qwen3-Next: 4)")


def layer_types(cfg) -> tuple[str, ...]:
    """Per layer, ``"global"`` or ``"local"``."""
    pattern = cfg.layer_pattern or (("local",) if cfg.sliding_window else ("global",))
    return tuple(pattern[i % len(pattern)] for i in range(cfg.num_layers))


def layer_windows(cfg) -> tuple:
    """Per attention layer (the linear layers left out), its window in tokens (``None``: global)."""
    return tuple(cfg.sliding_window if t == "local" else None for t in layer_types(cfg) if t != "linear")


def linear_layers(cfg) -> tuple[int, ...]:
    """The layers whose token mixer is the gated delta-net."""
    return tuple(i for i, t in enumerate(layer_types(cfg)) if t == "linear")


def attention_layers(cfg) -> tuple[int, ...]:
    """The layers whose token mixer is attention (global or local)."""
    return tuple(i for i, t in enumerate(layer_types(cfg)) if t != "linear")


MIXERS = ("attn", "delta")  # a hybrid's token mixers, by their names in the transformer's Block


def mixer_layers(cfg, mixer: str) -> tuple[int, ...]:
    """The layers whose parameters a hybrid's ``mixer`` stack holds, row by row (``"attn"``: the attention layers,
    ``"delta"``: the linear ones), so that no layer stores the other kind's parameters. A hybrid without attention
    layers keeps one attention row, unused."""
    return linear_layers(cfg) if mixer == "delta" else (attention_layers(cfg) or (0,))


def stacked_apart(cfg) -> tuple[str, ...]:
    """The transformer ``Block``'s modules stacked over their own layers only (``stacked_layers``), each layer reading
    its row inside the layer scan: a hybrid's token mixers (``"attn"``, ``"delta"``), and the dense MLP and the experts
    (``"mlp"``, ``"moe"``) of a model that mixes dense and sparse layers."""
    mixed = bool(cfg.num_experts) and cfg.has_dense_mlp
    return (MIXERS if linear_layers(cfg) else ()) + (("mlp", "moe") if mixed else ())


def stacked_layers(cfg, module: str) -> tuple[int, ...]:
    """The layer each row of the stacked ``Block`` module ``module`` (``"attn"``, ``"delta"``, ``"mlp"``, ...) holds:
    every layer, but for the modules ``stacked_apart`` (a token mixer's layers, ``mixer_layers``; the dense layers for
    ``"mlp"``, the sparse ones for ``"moe"``)."""
    if module not in stacked_apart(cfg):
        return tuple(range(cfg.num_layers))
    if module in MIXERS:
        return mixer_layers(cfg, module)
    return cfg.sparse_layers if module == "moe" else tuple(sorted(cfg.dense_layers))


def stack_rows(cfg, module: str) -> tuple[int, ...]:
    """Per layer, the row of ``module``'s stack it reads (``stacked_layers``); a layer that does not use the module
    reads row 0 (its switch or cond leaves it unused)."""
    rows = {layer: row for row, layer in enumerate(stacked_layers(cfg, module))}
    return tuple(rows.get(i, 0) for i in range(cfg.num_layers))


def kinds(cfg) -> tuple:
    """The distinct windows of the attention layers, global (``None``) first."""
    present = set(layer_windows(cfg))
    return tuple(sorted(present, key=lambda w: -1 if w is None else w))


def kind_index(cfg) -> tuple[int, ...]:
    """Per layer, the index of its window in :func:`kinds`; a linear layer's is ``len(kinds)`` (the branch after the
    attention kinds)."""
    table = kinds(cfg)
    windows = iter(layer_windows(cfg))
    return tuple(len(table) if t == "linear" else table.index(next(windows)) for t in layer_types(cfg))
