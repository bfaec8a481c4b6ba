"""A run remembers itself: configuration files and the run record.

A run directory (``--run-dir``)::

    run.json       the run record, written by ``train`` (process 0) once everything is checked: the effective
                   configuration (``config``), the model (``model``, ``compute``), the data sources and tokenizer with
                   content fingerprints (``data``, ``tokenizer``), the mesh, batch, schedule (with any re-planned
                   decay), and one entry per start in ``starts``. ``train --resume`` and ``eval`` read everything
                   from it.
    config.yaml    the same effective configuration as a config file: ``train --config R/config.yaml`` repeats the run
    checkpoints/   Orbax checkpoints (``checkpoint.py``)
    metrics.jsonl  one JSON object per training step; tensorboard/: the same as TensorBoard events
    eval.jsonl     one JSON object per ``ulysses-jax eval``

Configuration: defaults < the run's record (on resume) < ``--config FILE`` (YAML or TOML, nested like the flags:
``mesh: {sp: 8}`` for ``--mesh.sp 8``) < flags. What may change when a run continues is ``resume.py``'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import os
import pathlib
import types
import typing
from typing import Literal


RECORD = "run.json"
# Model fields that change how a step is computed, not what is learned: free to differ on resume and in eval.
COMPUTE_ONLY = ("attention_impl", "remat", "remat_every", "remat_nested", "loss_chunk", "mlp_chunk", "attn_chunk",
                "attn_head_chunk", "delta_head_chunk", "delta_precision", "delta_impl",
                "attn_recompute", "attn_keep", "mlp_keep", "attn_max_documents", "moe_impl", "scan_unroll",
                "compute_dtype")
CONFIG = "config.yaml"
VERSION = 1

# Fields of one invocation, never inherited from a record or written into one.
PER_INVOCATION = ("config", "run_dir", "resume", "resume_from", "profile_steps", "distributed", "coordinator_address",
                  "num_processes", "process_id", "peer_timeout")


# A setting that qualifies a tool, inherited from the run only while the tool stays on: a resume that switches the
# tool off (``--attn-chunk 0``, ``--remat none``, ``--eval-every 0``) drops the qualifiers the run gave it, unless they
# are given anew (then refused).
# (Run settings and model fields alike: eval and export drop a model's qualifiers the same way, ``switched_off``.)
QUALIFIES = {"attn_head_chunk": ("attn_chunk",), "attn_recompute": ("attn_chunk",), "remat_every": ("remat",),
             "remat_nested": ("remat",), "eval_batches": ("eval_every",), "eval_by_position": ("eval_every",),
             "eval_passkey": ("eval_every",), "eval_passkey_samples": ("eval_every", "eval_passkey"),
             "fp8_recipe": ("fp8",), "attn_keep": ("remat", "attn_chunk"),
             "mlp_keep": ("remat", "mlp_chunk", "remat_every")}
OFF = (None, 0, False, "none")  # a tool's values that switch it off
# (qualifier, tool): the tool's values that leave the qualifier something to do; any other switches it off
ONLY_WITH = {("remat_nested", "remat"): ("offload",), ("attn_keep", "attn_chunk"): (None, 0),
             ("mlp_keep", "remat"): ("full",), ("mlp_keep", "mlp_chunk"): (0,), ("mlp_keep", "remat_every"): (None, 1)}


def flag(path: str) -> str:
    """``"optim.warmup_steps"`` -> ``"--optim.warmup-steps"``."""
    return "--" + path.replace("_", "-")


def setting_paths(cls, prefix: str = "") -> set[str]:
    """Every setting of a config dataclass, nested ones as ``"optim.lr"``."""
    out = set()
    for f in dataclasses.fields(cls):
        t = typing.get_type_hints(cls)[f.name]
        out |= setting_paths(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else {prefix + f.name}
    return out


def given_settings(cls, args: list[str], files: tuple[dict, ...] = ()) -> set[str]:
    """The settings of ``cls`` that this invocation gives: in ``args`` (``--mesh.sp 8``, ``--attn-chunk=0``,
    ``--no-attn-recompute``, ``--optim.no-master-weights``: the flags tyro makes of the fields) or in ``files``
    (config files' contents)."""
    known, given = setting_paths(cls), set()
    for a in args:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0].replace("-", "_")
            head, dot, last = name.rpartition(".")
            given |= {n for n in (name, head + dot + last[3:] if last.startswith("no_") else None) if n in known}

    def walk(d: dict, prefix: str):
        for k, v in d.items():
            path = prefix + str(k).replace("-", "_")
            given.add(path) if not isinstance(v, dict) else walk(v, path + ".")

    for f in files:
        walk(f, "")
    return given


def _leaves_nothing_to_do(setting: str, tool: str, value) -> bool:
    """Whether ``tool``'s ``value`` switches off ``setting``, one of its ``QUALIFIES``."""
    accepted = ONLY_WITH.get((setting, tool))
    return value in OFF if accepted is None else value not in accepted


def switched_off(values, given) -> list[str]:
    """The ``QUALIFIES`` settings, not in ``given`` themselves, of a tool that ``given`` names with a value
    (``values[tool]``) that switches them off."""
    return [k for k, tools in QUALIFIES.items() if k not in given
            and any(t in given and _leaves_nothing_to_do(k, t, values[t]) for t in tools)]


def drop_qualifiers(cfg, given: set[str]):
    """``cfg`` (a resumed run's settings with this invocation's over them) without the ``QUALIFIES`` settings it
    inherited for a tool that ``given`` (``given_settings``) switches off: they go back to their defaults."""
    defaults, values = type(cfg)(), {t: getattr(cfg, t) for tools in QUALIFIES.values() for t in tools}
    return dataclasses.replace(cfg, **{k: getattr(defaults, k) for k in switched_off(values, given)})


# ------------------------------------------------------------------------------------ config files


def load_config_file(path: str | os.PathLike) -> dict:
    """A YAML (``.yaml``/``.yml``) or TOML (``.toml``) file as a dict; errors name the file and the fix."""
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--config {path} does not exist; pass a .yaml or .toml file")
    try:
        raw = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(raw)
        else:
            raise ValueError(f"--config {path}: unknown extension {p.suffix!r}; use a .yaml, .yml or .toml file")
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - yaml.YAMLError and tomllib.TOMLDecodeError
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"--config {path} is not valid {suffix[1:].upper()} ({why}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of settings (such as `steps: 100`), not a "
                         f"{type(data).__name__}")
    keys = {str(k).replace("-", "_"): v for k, v in data.items()}
    if given := [k for k in ("resume", "resume_from") if keys.get(k) not in (None, False)]:  # read before any file
        how = "--resume" if given[0] == "resume" else "--resume-from N"
        raise ValueError(f"--config {path} sets {given[0]}, which continues a run; give it on the command line "
                         f"(--run-dir R {how}), where it reads the run's settings first")
    return data


def _type_name(t) -> str:
    origin = typing.get_origin(t)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(t))
    if origin is tuple:
        return "a list of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(t, getattr(t, "__name__", str(t)))


def _convert(value, t, where: str):
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(t):
            try:
                return _convert(value, arg, where)
            except ValueError:
                continue
        raise ValueError(f"{where} is {value!r}, not {_type_name(t)}")
    if origin is Literal:
        if value in typing.get_args(t):
            return value
        raise ValueError(f"{where} is {value!r}, not {_type_name(t)}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value):
            return tuple(str(v) for v in value)
        raise ValueError(f"{where} is {value!r}, not {_type_name(t)}")
    if t is type(None):
        if value is None:
            return None
    elif t is bool:
        if isinstance(value, bool):
            return value
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif t is str:
        if isinstance(value, str):
            return value
    raise ValueError(f"{where} is {value!r}, not {_type_name(t)}")


def apply(base, values: dict, *, where: str, prefix: str = ""):
    """``base`` (a frozen config dataclass) with ``values`` (nested dicts, keys with ``_`` or ``-``) replaced.

    Unknown keys and values of the wrong type raise ``ValueError`` naming ``where`` (the file), the key and the fix.
    """
    cls = type(base)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    changes = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        path = prefix + name
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: unknown setting {prefix + str(key)!r}; {hint}the settings are the flags of "
                             f"`--help` without the dashes ({', '.join(names[:6])}, ...)")
        t = hints[name]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {path} must be a mapping such as `{name}: {{...}}`, not {value!r}")
            changes[name] = apply(getattr(base, name), value, where=where, prefix=path + ".")
        else:
            changes[name] = _convert(value, t, f"{where}: {path}")
    return dataclasses.replace(base, **changes)


def to_dict(cfg, *, skip: tuple[str, ...] = ()) -> dict:
    """A config dataclass as nested plain data (tuples as lists), without the fields in ``skip``."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.name in skip:
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def get(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


# ------------------------------------------------------------------------------------ the run directory


@dataclasses.dataclass(frozen=True)
class RunDir:
    """What a run directory holds now (nothing is created by looking)."""

    path: pathlib.Path
    exists: bool
    record: bool
    steps: tuple[int, ...]  # finished checkpoints
    metrics: bool  # metrics.jsonl or tensorboard/ events

    @property
    def checkpoints(self) -> pathlib.Path:
        return self.path / "checkpoints"

    def pick_step(self, step: int | None, *, none: str, flag: str = "--step") -> int:
        """``step`` (None: the latest) if it is a finished checkpoint; ``none``: the error when there is none;
        ``flag``: the flag that named ``step``."""
        if not self.steps:
            raise ValueError(none)
        if step is None:
            return self.steps[-1]
        if step not in self.steps:
            raise ValueError(f"{flag} {step}: no such checkpoint in {self.checkpoints} (steps: "
                             f"{', '.join(map(str, self.steps))})")
        return step


def inspect(run_dir: str | os.PathLike) -> RunDir:
    p = pathlib.Path(run_dir)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file; choose a directory path with --run-dir")
    ckpts = p / "checkpoints"
    found = ckpts.iterdir() if ckpts.is_dir() else ()
    steps = tuple(sorted(int(c.name) for c in found if c.name.isdigit() and c.is_dir()))  # a stray file is none
    metrics = (p / "metrics.jsonl").exists() or any((p / "tensorboard").glob("events.out.tfevents.*"))
    return RunDir(p, p.is_dir(), (p / RECORD).is_file(), steps, metrics)


def read_record(run_dir: str | os.PathLike) -> dict:
    """The run record of ``run_dir``; ``ValueError`` when it is missing or not one."""
    path = pathlib.Path(run_dir) / RECORD
    if not path.is_file():
        raise ValueError(f"{path} not found: {run_dir} is not a training run directory; pass the --run-dir of a run "
                         f"written by `ulysses-jax train`")
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record["model"], dict):
            raise TypeError("not a mapping with a model")
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); check the file system") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a readable ulysses-jax run record ({type(e).__name__}: {e}); "
            f"pass the --run-dir of a run written by `ulysses-jax train`"
        ) from None
    if "config" not in record or record.get("version", 0) > VERSION:
        raise ValueError(f"{path} was written by another version of ulysses-jax (no configuration of version "
                         f"{VERSION}); continue it with that version, or start a new --run-dir")
    return record


def write_record(run_dir: str | os.PathLike, record: dict, as_given: dict | None = None) -> None:
    """Write ``run.json`` and ``config.yaml`` atomically (process 0 only: the caller checks). ``as_given``: the
    settings' defaults (``to_dict`` of a default config): in ``config.yaml`` the optimizer settings the run derived
    (the record's ``defaults`` of ``optim``: the schedule from ``--steps``, the rates of a fine-tuning run) keep
    these, so a new run from the file derives them again (a longer ``--steps``: its own schedule); ``run.json``
    keeps what this run used. What ``--memory auto`` chose stays in the file, as a resume keeps it."""
    import yaml

    p = pathlib.Path(run_dir)
    p.mkdir(parents=True, exist_ok=True)
    _atomic_write(p / RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
    config = json.loads(json.dumps(record["config"]))
    derived = sorted(k for k in record.get("defaults", {}) if k.startswith("optim."))
    for path in derived if as_given is not None else ():
        *head, last = path.split(".")
        node = config
        for part in head:
            node = node.setdefault(part, {})
        node[last] = get(as_given, path)
    header = ("# The configuration of this run (written by `ulysses-jax train`). Repeat it in a new directory with\n"
              "# `ulysses-jax train --config <this file> --run-dir <new>`; continue it with\n"
              "# `ulysses-jax train --run-dir <this run> --resume`.\n")
    if derived and as_given is not None:
        header += (f"# Derived by the run, left to be derived again (run.json has the values it used): "
                   f"{', '.join(derived)}.\n")
    _atomic_write(p / CONFIG, header + yaml.safe_dump(config, sort_keys=False))


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------ the record of a run


def make_record(cfg, model, mesh, batch_size: int, optim, horizon: int, replans: list, sources: list[dict],
                tokenizer: dict) -> dict:
    """The run record (module doc) of a ``TrainConfig`` about to run; ``starts`` and ids are added by the caller.

    ``optim``: the schedule as first planned; ``horizon``: where its decay ends now (``replans``' last, if any).
    Data and tokenizer paths are recorded resolved (``sources``, ``tokenizer``: ``data.describe_*``).
    """
    import jax

    train = [d["path"] for d in sources if d["role"] == "train" and d["kind"] != "builtin"]
    evals = [d["path"] for d in sources if d["role"] == "eval"]
    effective = dataclasses.replace(cfg, batch_size=batch_size, optim=dataclasses.replace(optim, decay_steps=horizon),
                                    data=tuple(train), eval_data=tuple(evals), tokenizer=tokenizer["path"])
    # tuples (layer_pattern, the LoRA targets) as the lists run.json gives back, so a resumed run compares equal
    fields = json.loads(json.dumps(dataclasses.asdict(model)))
    return {
        "version": VERSION,
        "config": to_dict(effective, skip=PER_INVOCATION),
        "model": {k: v for k, v in fields.items() if k not in COMPUTE_ONLY},
        "compute": {k: fields[k] for k in COMPUTE_ONLY},
        "seq_len": cfg.seq_len,
        "batch_size": batch_size,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "data": sources,
        "tokenizer": tokenizer,
        "schedule": {"warmup_steps": optim.warmup_steps, "decay_steps": optim.decay_steps, "replans": replans},
        # the optimizer-state tree differs with and without clipping (and master weights, a LEARNED setting refused
        # by its flag's name before this is compared): a resume must keep that choice
        "optimizer": "adamw+clip" if optim.clip_norm else "adamw",
    }
