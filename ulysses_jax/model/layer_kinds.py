"""Per-layer attention kinds: which layers are global (full causal) and which local (a sliding window), checked.

``ModelConfig.layer_pattern`` is repeated over the layers and cut at ``num_layers`` (Gemma 3: five "local" then one
"global", 26 or 34 layers); a pattern as long as the model lists every layer (Qwen2's ``max_window_layers``). An empty
pattern means every layer "local" when ``sliding_window > 0``, else every layer "global". The transformer scans its
stacked layers once whatever the pattern: each layer's kind index (into ``kinds``) is scanned with its parameters and
a ``lax.switch`` picks the attention of that kind (``model/transformer.py``). A kind is the window (``None``: global);
the local layers also take their own RoPE base (``rope_local_theta``). This module reads a config's attributes and
imports nothing of the package (``model/config.py`` calls it).
"""

from __future__ import annotations

LAYER_TYPES = ("global", "local")


def check_layers(cfg) -> None:
    """Raise ``ValueError`` naming the field for a bad window, pattern or Gemma-3 setting."""
    window = cfg.sliding_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"sliding_window ({window!r}) must be 0 (no local layers) or a positive number of tokens")
    pattern = cfg.layer_pattern
    if not isinstance(pattern, tuple):
        raise ValueError(f"layer_pattern ({pattern!r}) must be a tuple of 'global' / 'local'")
    for kind in pattern:
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_pattern has {kind!r}, an unknown layer type; use 'global' or 'local'")
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


def layer_types(cfg) -> tuple[str, ...]:
    """Per layer, ``"global"`` or ``"local"``."""
    pattern = cfg.layer_pattern or (("local",) if cfg.sliding_window else ("global",))
    return tuple(pattern[i % len(pattern)] for i in range(cfg.num_layers))


def layer_windows(cfg) -> tuple:
    """Per layer, its window in tokens (``None``: global)."""
    return tuple(cfg.sliding_window if t == "local" else None for t in layer_types(cfg))


def kinds(cfg) -> tuple:
    """The distinct windows of the layers, global (``None``) first."""
    present = set(layer_windows(cfg))
    return tuple(sorted(present, key=lambda w: -1 if w is None else w))


def kind_index(cfg) -> tuple[int, ...]:
    """Per layer, the index of its window in :func:`kinds`."""
    table = kinds(cfg)
    return tuple(table.index(w) for w in layer_windows(cfg))
