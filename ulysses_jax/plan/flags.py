"""The ``ulysses-jax train`` flags of a planned program (the plan's ``train_args``): every setting the compiled
step depends on, resolved as the plan resolved it (mesh, batch, memory pool), so that ``train`` with these flags
compiles the program ``plan`` compiled (tests/test_plan.py compares the two HLOs). They end with ``--memory manual``:
``train`` runs the memory tools planned (the preset's, where the plan has none), never a search of its own.
"""

from __future__ import annotations

import dataclasses

from ulysses_jax.train.config import TrainConfig
from ulysses_jax.train.devices import MeshConfig

# TrainConfig fields the compiled step depends on (the model, its shapes and memory tools, the optimizer and its
# schedule, the mesh, the batch) and the memory pool it was planned in; the others (data, run, logging, process)
# do not change the program.
PROGRAM_FIELDS = ("init_from_hf", "preset", "tokenizer", "steps", "seq_len", "batch_size", "grad_accum", "mesh",
                  "attention", "remat", "remat_every", "remat_nested", "loss_chunk", "mlp_chunk", "attn_chunk",
                  "attn_head_chunk", "delta_head_chunk", "delta_precision", "delta_impl", "sliding_window",
                  "attn_recompute", "attn_keep", "mlp_keep", "attn_max_documents", "param_dtype", "offload_params",
                  "scan_unroll", "optim", "memory_fraction", "router_aux_loss_coef", "moe_impl", "lora_rank",
                  "lora_alpha", "lora_targets", "lora_dropout", "fp8", "fp8_recipe")
ALWAYS = ("preset", "seq_len", "batch_size", "mesh", "memory_fraction")  # written even when they are the defaults
# the data settings given to plan: they do not change the program, but a command without them trains on other data
DATA_FIELDS = ("data", "data_field", "data_format", "sft_overlong", "eval_data", "eval_fraction")


def _flag(path: str, value) -> list[str]:
    """One setting as the flags tyro parses: ``--a.b-c V``, a bool as ``--x`` / ``--no-x`` (``--a.no-x`` nested)."""
    head, _, name = path.rpartition(".")
    prefix = f"--{head.replace('_', '-')}." if head else "--"
    if isinstance(value, bool):
        return [f"{prefix}{'' if value else 'no-'}{name.replace('_', '-')}"]
    if isinstance(value, (tuple, list)):
        return [f"{prefix}{name.replace('_', '-')}", *map(str, value)]
    return [f"{prefix}{name.replace('_', '-')}", "None" if value is None else str(value)]


def train_args(cfg: TrainConfig, *, seq_len: int, batch_size: int, mesh: dict[str, int],
               memory_fraction: float) -> list[str]:
    """The ``train`` flags of ``cfg``'s program at ``seq_len`` on ``mesh`` (module doc)."""
    resolved = dataclasses.replace(cfg, seq_len=seq_len, batch_size=batch_size, memory_fraction=memory_fraction,
                                   mesh=MeshConfig(**{a: mesh[a] for a in ("data", "fsdp", "ring", "sp")}))
    default = TrainConfig()
    args: list[str] = []
    for name in PROGRAM_FIELDS + DATA_FIELDS:
        value, was = getattr(resolved, name), getattr(default, name)
        if name == "preset" and resolved.init_from_hf is not None:
            continue  # the model is the folder's
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if name in ALWAYS or v != getattr(was, f.name):
                    args += _flag(f"{name}.{f.name}", v)
        elif name in ALWAYS or value != was:
            args += _flag(name, value)
    return args + ["--memory", "manual"]
