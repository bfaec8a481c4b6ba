"""``ulysses-jax export``: a run's checkpoint as a Hugging Face folder that transformers loads.

Everything comes from the run's record: the model (``run.json``'s ``model``), the checkpoint (the latest, or
``--step``), the tokenizer files (copied from the run's ``--init-from-hf`` folder, or from the folder of its
``--tokenizer``; a run on UTF-8 bytes has none). A base folder that moved since the run is named with ``--base``.
A LoRA run exports its adapters as a peft folder (``base_model_name_or_path``: where the base is now), or with
``--merge`` the base folder's own tensors with the adapters added to the targeted ones (``interop/peft.py``). The parameters are restored onto a mesh of the local devices (8 fake
CPU devices without an accelerator, as ``train``) and written by ``hf.to_hf``: ``config.json`` (Llama, Qwen2, Qwen3
or Mistral, whichever holds the model) and ``generation_config.json``, safetensors shards of at most 5 GB with their
index, gathered one tensor at a time. A run with ``--optim.master-weights`` exported in a dtype other than its
parameters' (``--dtype float32`` of a bfloat16 run) is written from its float32 master weights instead. Nothing is
written until every check has passed: a non-empty ``--out``, a run without checkpoints, a missing step, a model with
no Hugging Face architecture, a tokenizer changed since the run.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from typing import Literal

from ulysses_jax.train import runconfig
from ulysses_jax.train.devices import MeshConfig, build_mesh


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """Write a run's checkpoint as a Hugging Face model folder (config.json, safetensors, tokenizer files)."""

    run_dir: str  # the run to export
    out: str  # the folder to write: new or empty
    step: int | None = None  # the checkpoint to export; None: the latest
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # the tensors' dtype in the files; None: the run's
    merge: bool = False
    """a LoRA run (--lora-rank): write its base with the adapters merged in (W + alpha/r B A) as a full model folder,
    instead of the peft adapter folder; from the --init-from-hf folder's own tensors, the others copied exactly"""
    base: str | None = None
    """the run's --init-from-hf folder where it is now, when it moved since the run last read it (checked against the
    run's record by content); None: where the run last read it"""
    cpu_devices: int = 8  # fake CPU devices when there is no accelerator
    distributed: bool = False  # multi-host: call jax.distributed.initialize() (cluster settings auto-detected)
    coordinator_address: str | None = None  # multi-host without a cluster manager: "host:port" of process 0
    num_processes: int | None = None  # ... with the number of processes
    process_id: int | None = None  # ... and this process's index


def _base_folder(record: dict, given: str | None) -> pathlib.Path | None:
    """The run's ``--init-from-hf`` folder as it is now: ``--base`` (checked against the record by content), or the
    path the run last read; None when the run has none, or when that path is gone and no ``--base`` says where."""
    from ulysses_jax.train.resume import describe_hf_folder

    recorded = record.get("init_from_hf")
    if given is None:
        if recorded is None or not (pathlib.Path(recorded["path"]) / "config.json").is_file():
            return None
        return pathlib.Path(recorded["path"])
    if recorded is None:
        raise ValueError(f"--base {given}: the run did not start from a Hugging Face folder (no --init-from-hf); drop "
                         f"--base (nothing was written)")
    if not (pathlib.Path(given).expanduser() / "config.json").is_file():
        raise ValueError(f"--base {given} has no config.json; pass the Hugging Face folder the run started from "
                         f"(nothing was written)")
    now = describe_hf_folder(given)
    if now["fingerprint"] != recorded["fingerprint"]:
        raise ValueError(f"--base {given} is not the run's folder (its settings files differ from those of "
                         f"{recorded['path']}, which the run read); pass the folder the run started from")
    return pathlib.Path(now["path"])


def _tokenizer_source(record: dict, base: pathlib.Path | None) -> tuple[pathlib.Path | None, pathlib.Path | None]:
    """``(folder whose tokenizer files and generation_config.json go along, the run's tokenizer.json)``; a tokenizer
    that lived in the run's base folder is looked for where that folder is now (``base``)."""
    from ulysses_jax.data.tokenizers import describe_tokenizer

    tok = record.get("tokenizer") or {}
    if not tok.get("path"):
        return None, None  # UTF-8 bytes: no tokenizer files
    path = pathlib.Path(tok["path"])
    recorded_base = (record.get("init_from_hf") or {}).get("path")
    if base is not None and recorded_base and path.parent == pathlib.Path(recorded_base):
        path = base / path.name
    if not path.is_file():
        hint = " or, if the run's base folder moved, pass it with --base DIR" if recorded_base else ""
        raise ValueError(f"the run's tokenizer {path} is gone; put it back{hint} to export its files with the model")
    if describe_tokenizer(str(path)).get("fingerprint") != tok.get("fingerprint"):
        raise ValueError(f"the run's tokenizer {path} has changed since the run; restore the file it was trained with")
    return path.parent, path


def export_run(cfg: ExportConfig) -> dict:
    """Write ``cfg.run_dir``'s checkpoint into ``cfg.out`` (module doc); ``ValueError`` before writing on bad input."""
    from flax import nnx

    from ulysses_jax.interop import hf
    from ulysses_jax.train.checkpoint import Checkpointer
    from ulysses_jax.train.config import model_config_from_run
    from ulysses_jax.train.step import abstract_state

    run_dir = pathlib.Path(cfg.run_dir)
    out = pathlib.Path(cfg.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {cfg.out} is not an empty folder; export into a new or empty folder (nothing was "
                         f"written)")
    record = runconfig.read_record(run_dir)
    where = runconfig.inspect(run_dir)
    step = where.pick_step(cfg.step, none=f"--run-dir {cfg.run_dir} has no checkpoint in {where.checkpoints}; train "
                                          f"it first")
    model_cfg = model_config_from_run(record)
    if cfg.merge and model_cfg.lora is None:
        raise ValueError(f"--merge merges a LoRA run's adapters into its base, but {cfg.run_dir} trained every "
                         f"parameter (no --lora-rank); export it without --merge (nothing was written)")
    if record["seq_len"] > model_cfg.max_seq_len:  # trained past the folder's length: config.json says so
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=record["seq_len"])
    base = _base_folder(record, cfg.base)
    if cfg.merge and base is None and record.get("init_from_hf"):
        raise ValueError(f"--merge adds the adapters to the tensors of the run's base folder "
                         f"{record['init_from_hf']['path']}, which is gone; pass where it is now with --base DIR "
                         f"(nothing was written)")
    folder, tokenizer = _tokenizer_source(record, base)
    source_config = hf.read_json(folder / "config.json") if folder and (folder / "config.json").is_file() else {}
    arch = hf.export_architecture(model_cfg, source_config.get("architectures"))  # refuses what HF cannot hold
    mesh = build_mesh(MeshConfig(), model_cfg, record["seq_len"])
    checkpointer = Checkpointer(run_dir, keep=10**6, create=False)
    # with master weights, the float32 masters are the weights, the parameters their rounding: another dtype is
    # written from the masters (float32 exactly; float16 rounded once, not twice)
    masters = bool(runconfig.get(record["config"], "optim.master_weights")) and cfg.dtype not in (
        None, model_cfg.param_dtype) and model_cfg.lora is None  # with LoRA the masters are the adapters' alone
    try:
        graphdef, target = abstract_state(model_cfg, mesh)  # parameters only: the moments are not read
        if masters:
            params = checkpointer.restore_master(step, target["params"])
        else:
            params = checkpointer.restore(step, target, params_only=True)[0]["params"]
    finally:
        checkpointer.close()
    model = nnx.merge(graphdef, params)
    if model_cfg.lora is not None and not cfg.merge:  # the adapters alone, as peft loads them onto the base
        from ulysses_jax.interop import peft

        recorded = (record.get("init_from_hf") or {}).get("path")
        base_model = str(base) if base is not None else recorded
        files = peft.write_adapter(model, out, base_model=base_model, tokenizer_from=folder, dtype=cfg.dtype)
        return {"step": step, "out": str(out), "architecture": "peft LoRA adapter", "files": files,
                "tokenizer_from": str(folder) if folder else None, "base_model": base_model, "lora": True,
                "preset": None if base_model else model_cfg.name, "base_gone": base is None and bool(recorded)}
    if model_cfg.lora is not None and base is not None:  # from the folder's own tensors, the rest copied exactly
        from ulysses_jax.interop import peft

        files = peft.merge_into_folder(model, base, out, dtype=cfg.dtype, max_position=record["seq_len"])
        if tokenizer is not None and tokenizer.name != "tokenizer.json" and (out / "config.json").is_file():
            shutil.copyfile(tokenizer, out / "tokenizer.json")
        return {"step": step, "out": str(out), "architecture": arch, "files": files,
                "tokenizer_from": str(folder) if folder else None}
    if model_cfg.lora is not None:  # a preset's base: the run's own copy is the base
        from ulysses_jax.interop import peft

        model = peft.merged(model)
    hf.to_hf(model, out, tokenizer_from=folder, dtype=cfg.dtype)
    if tokenizer is not None and tokenizer.name != "tokenizer.json" and (out / "config.json").is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")  # a tokenizer file of another name goes in as HF names it
    return {"step": step, "out": str(out), "architecture": arch, "files": sorted(p.name for p in out.iterdir()),
            "tokenizer_from": str(folder) if folder else None}
