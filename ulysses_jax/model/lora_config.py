"""``LoraConfig``: the frozen description of the LoRA adapters a model trains (``ModelConfig.lora``; ``lora.py`` holds
the adapters themselves).

Kept apart from ``lora.py`` so that ``config.py`` can name it without importing the layers.
"""

from __future__ import annotations

import dataclasses

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS  # the default: every projection of the attention and the dense MLP
# the gated delta-net's projections (Qwen3.5's module names): q, k and v in one (in_proj_qkv), z, b, a, out
DELTA_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
DELTA_DEFAULT = ("in_proj_qkv", "in_proj_z", "out_proj")  # added to a hybrid's default targets
ALL_TARGETS = TARGETS + DELTA_TARGETS
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
            "down": "down_proj", **{t: t for t in DELTA_TARGETS}}  # the Hugging Face module names (peft's)


def default_targets(model) -> tuple[str, ...]:
    """The projections ``--lora-rank`` adapts when ``--lora-targets`` is not given: the seven (the attention's alone
    with experts, whose LoRA is not supported), and on a hybrid the delta-net's ``DELTA_DEFAULT`` too."""
    return (ATTENTION_TARGETS if model.num_experts else TARGETS) + (DELTA_DEFAULT if model.linear_layers else ())


def parse_targets(text: str | tuple | list) -> tuple[str, ...]:
    """``"q,k,v"`` (or peft's ``q_proj``, ...) -> ``("q", "k", "v")`` in the order of ``TARGETS``; unknown names are
    kept for ``LoraConfig.check`` to refuse with the ones the model has."""
    items = text.split(",") if isinstance(text, str) else list(text)
    by_hf = {v: k for k, v in HF_NAMES.items()}
    names = [by_hf.get(t.strip(), t.strip()) for t in items if t.strip()]
    known = [t for t in ALL_TARGETS if t in names]
    return tuple(known + [t for t in dict.fromkeys(names) if t not in ALL_TARGETS])


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters ``W + (alpha / rank) A B`` on the ``targets`` projections; the rest of the model is frozen.

    ``dropout``: the probability of zeroing each element of an adapter's input while training (peft's
    ``lora_dropout``), each target its own mask; the frozen weight's product sees the whole input.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.targets, (list, str)):  # from JSON (run.json) or a comma-separated flag
            object.__setattr__(self, "targets", parse_targets(self.targets))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"--lora-rank ({self.rank!r}) must be a positive integer, e.g. 8 or 16")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"--lora-alpha ({self.alpha!r}) must be a positive number (default: 2 x --lora-rank)")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not self.targets:
            raise ValueError(f"--lora-targets names no projection; choose from {','.join(TARGETS)}")
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(f"--lora-targets {unknown[0]!r} is not a projection this model has; it has "
                             f"{','.join(TARGETS)} (or their Hugging Face names q_proj, ..., down_proj), and a hybrid "
                             f"(Qwen3.5) also {','.join(DELTA_TARGETS)}")
        ok = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool) and 0 <= self.dropout < 1
        if not ok:
            raise ValueError(f"--lora-dropout ({self.dropout!r}) must be a probability in [0, 1), e.g. 0.05 or 0.1")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor on ``A B`` (peft's ``scaling``)."""
        return self.alpha / self.rank

    def check(self, model) -> None:
        """``ValueError`` when a target is not in ``model`` (a ``ModelConfig``): the MLP projections of a model whose
        layers are all experts (LoRA on experts is not modelled), or of any mixture of experts."""
        if model.num_experts:
            mlp = [t for t in self.targets if t in MLP_TARGETS]
            if mlp:
                raise ValueError(f"--lora-targets {mlp[0]!r}: {model.name}'s MLP is a mixture of experts, and LoRA on "
                                 f"experts is not supported; it has {','.join(ATTENTION_TARGETS)} (pass --lora-targets "
                                 f"{','.join(ATTENTION_TARGETS)})")
        delta = [t for t in self.targets if t in DELTA_TARGETS]
        if delta and not model.linear_layers:
            raise ValueError(f"--lora-targets {delta[0]!r}: {model.name} has no gated delta-net ('linear') layer; it "
                             f"has {','.join(TARGETS)}")
        sides = projection_sides(model)
        narrow = min(self.targets, key=lambda t: min(sides[t]))
        if self.rank > min(sides[narrow]):
            d_in, d_out = sides[narrow]
            raise ValueError(f"--lora-rank {self.rank} is larger than the {narrow} projection's smaller side "
                             f"({min(d_in, d_out)}: it maps {d_in} to {d_out}), so the adapter would hold more "
                             f"parameters than the weight it adapts; use --lora-rank {min(d_in, d_out)} or less")
        attn = [t for t in self.targets if t in ATTENTION_TARGETS]
        if self.dropout and model.attn_chunk and attn:
            raise ValueError(f"--lora-dropout {self.dropout:g} with --attn-chunk {model.attn_chunk} on the attention "
                             f"targets ({','.join(attn)}) is not supported: the tiled attention reads merged weights, "
                             f"which leave no adapter input to drop; use --lora-dropout 0, or leave --attn-chunk unset")

    def describe(self) -> str:
        return (f"rank {self.rank}, alpha {self.alpha:g} (scale {self.scale:g}), dropout {self.dropout:g}, on "
                f"{','.join(self.targets)}")


def projection_sides(model) -> dict[str, tuple[int, int]]:
    """Per target, the (input, output) width of its projection in ``model`` (a ``ModelConfig``); q's output doubled
    by an output gate."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    d, f = model.hidden, model.mlp_dim
    keys = model.linear_num_key_heads * model.linear_key_head_dim
    values = model.linear_num_value_heads * model.linear_value_head_dim
    heads = model.linear_num_value_heads
    return {"q": (d, 2 * q if model.attn_output_gate else q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f),
            "up": (d, f), "down": (f, d), "in_proj_qkv": (d, 2 * keys + values), "in_proj_z": (d, values),
            "in_proj_b": (d, heads), "in_proj_a": (d, heads), "out_proj": (values, d)}


def target_layers(model, target: str) -> tuple[int, ...]:
    """The layers whose module ``target`` adapts: a hybrid's attention or delta-net layers, or every layer."""
    if target in DELTA_TARGETS:
        return model.linear_layers
    return model.attention_layers if target in ATTENTION_TARGETS else tuple(range(model.num_layers))
