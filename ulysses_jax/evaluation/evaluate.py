"""``ulysses-jax eval``: loss and perplexity of a run's checkpoint, everything read from the run's record.

The documents are the run's eval split (its ``--eval-data``, or the documents its ``--eval-fraction`` held out) unless
``--eval-data`` names others. Other data (or the run's data changed on disk) and another tokenizer are refused: their
"held-out" documents may have been trained on. The mesh, batch and memory tools may differ from the run's, so a
checkpoint trained on many devices is evaluated on few. It reads only, except for its result: one line in
``eval.jsonl`` and ``eval/`` scalars in TensorBoard, written into a run that has checkpoints.

``--by-position`` adds the loss in position buckets (``position.py``: ``eval_by_position.json`` and a PNG) and
``--task passkey`` passkey retrieval at the asked lengths and depths (``passkey_eval.py``: ``eval_passkey.json`` and a
heat map); ``--steps 100,200,last`` evaluates several checkpoints (one line each in the plot of positions; the passkey
heat map is the last step's).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Literal

import jax
import numpy as np

from ulysses_jax.data.documents import DataConfig, describe_sources, sources_differ, validate_sources
from ulysses_jax.data.pipeline import eval_batches
from ulysses_jax.data.tokenizers import describe_tokenizer
from ulysses_jax.evaluation import passkey_eval, plots, position
from ulysses_jax.evaluation.token_scores import make_token_step
from ulysses_jax.kernels.segments import documents_per_row
from ulysses_jax.train import resume, runconfig
from ulysses_jax.train.checkpoint import Checkpointer
from ulysses_jax.train.config import Impl, Paths, Remat, model_config_from_run
from ulysses_jax.train.devices import (
    MeshConfig,
    build_mesh,
    check_parallel,
    documents_limit,
    memory_pool,
    resolve_batch,
)
from ulysses_jax.train.eval_loss import evaluate_loss
from ulysses_jax.train.metrics import log_eval
from ulysses_jax.train.step import abstract_state, make_eval_step, state_shardings


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Loss and perplexity of a run's checkpoint on its held-out documents (or --eval-data); reads the run's record."""

    run_dir: str  # the run to evaluate
    step: int | None = None  # the checkpoint to evaluate; None: the latest
    steps: str | None = None  # several checkpoints, comma-separated ("100,200,last"); overrides --step
    by_position: bool = False  # also the loss in log-spaced position buckets: eval_by_position.json and a PNG
    task: Literal["passkey"] | None = None  # passkey: retrieval accuracy by length and depth (eval_passkey.json, PNG)
    lengths: str | None = None  # passkey sample lengths, comma-separated; None: the run's --seq-len and its halves
    depths: str = "0,0.25,0.5,0.75,1"  # where the needle starts in the context (0: first token, 1: at the end)
    samples: int = 5  # passkey samples per (length, depth)
    passkey_digits: int = 5  # digits of each key
    passkey_filler: Literal["fixed", "data"] = "fixed"  # haystack: a fixed text, or the run's held-out documents
    seed: int = 0  # passkey keys and filler offsets
    plot: bool = True  # draw the PNGs beside the JSON files
    harness_task: str | None = None  # with --task passkey: also write its samples here as an lm-evaluation-harness task
    mesh: MeshConfig = MeshConfig()  # no --mesh.* flag: the run's own mesh, if this job has as many devices
    memory_fraction: float | None = None
    """share of each GPU's memory JAX's pool takes; None: the pool the run trained in (run.json), else 0.95; the
    environment's XLA_PYTHON_CLIENT_MEM_FRACTION wins, as for train"""
    batch_size: int | None = None  # rows per batch; None: the run's, if the mesh divides it
    max_batches: int = 16  # batches to read (0: all)
    attention: Impl = "auto"  # attention kernel
    remat: Remat | None = None  # memory tools, to fit on another mesh; None: the run's
    loss_chunk: int | None = None  # tiled loss chunk in tokens; None: the run's
    mlp_chunk: int | None = None  # tiled MLP chunk in tokens; None: the run's
    attn_chunk: int | None = None  # tiled attention chunk in tokens; None: the run's
    attn_head_chunk: int | None = None  # query heads per device per group of the tiled attention; None: the run's
    eval_data: Paths = ()  # evaluate on these documents instead of the run's eval split
    data: Paths = ()  # where the run's --data is now, if it moved (checked against the run's fingerprints)
    tokenizer: str | None = None  # where the run's --tokenizer is now, if it moved (checked likewise)
    cpu_devices: int = 8  # fake CPU devices when there is no accelerator
    distributed: bool = False  # multi-host: call jax.distributed.initialize() (cluster settings auto-detected)
    coordinator_address: str | None = None  # multi-host without a cluster manager: "host:port" of process 0
    num_processes: int | None = None  # ... with the number of processes
    process_id: int | None = None  # ... and this process's index


def evaluate(cfg: EvalConfig) -> dict:
    """Loss and perplexity of a checkpoint of the run on its eval split (or ``--eval-data``); reads the run's record,
    refuses other data or another tokenizer, writes only ``eval.jsonl`` and TensorBoard events into the run."""
    run_dir = pathlib.Path(cfg.run_dir)
    record = runconfig.read_record(run_dir)
    where = runconfig.inspect(run_dir)
    if not where.steps:
        raise ValueError(f"no checkpoint in {where.checkpoints}; train first or pass the --run-dir of a run")
    rc = record["config"]
    tokenizer = describe_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else rc.get("tokenizer"))
    why = resume.tokenizer_difference(record.get("tokenizer"), tokenizer)
    if why:
        raise ValueError(f"{why}; evaluate with the run's own tokenizer (leave out --tokenizer)")
    # documents as the run read them: SFT records or text, framed with BOS/EOS when it started from an HF folder
    documents = dict(format=rc.get("data_format", "text"), frame=rc.get("init_from_hf") is not None,
                     sft_overlong=rc.get("sft_overlong", "refuse"))
    if cfg.eval_data:
        data_cfg = DataConfig(paths=tuple(cfg.eval_data), eval_paths=tuple(cfg.eval_data), eval_fraction=0.0,
                              tokenizer=tokenizer["path"], text_field=rc.get("data_field", "text"), **documents)
        validate_sources(data_cfg, need_eval=True)
        what = f"--eval-data {' '.join(cfg.eval_data)}"
    else:
        data_cfg = DataConfig(paths=tuple(cfg.data or rc.get("data", ())), tokenizer=tokenizer["path"],
                              text_field=rc.get("data_field", "text"), eval_fraction=rc.get("eval_fraction", 0.02),
                              eval_paths=tuple(rc.get("eval_data", ())), **documents)
        validate_sources(data_cfg, need_eval=True)
        why = sources_differ(record.get("data", []), describe_sources(data_cfg))
        if why:
            raise ValueError(f"{why}: its held-out documents may have been trained on; evaluate the run's own data "
                             f"(--data where it is now, if it moved) or other documents with --eval-data")
        what = "the run's --eval-data" if rc.get("eval_data") else "the run's held-out documents"
    model = model_config_from_run(record, attention_impl=cfg.attention, remat=cfg.remat, loss_chunk=cfg.loss_chunk,
                                  mlp_chunk=cfg.mlp_chunk, attn_chunk=cfg.attn_chunk,
                                  attn_head_chunk=cfg.attn_head_chunk)
    seq_len = record["seq_len"]
    mesh = build_mesh(eval_mesh(cfg.mesh, record), model, seq_len)
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    batch_size = cfg.batch_size or (record.get("batch_size") if record.get("batch_size", 1) % rows == 0 else None)
    batch_size = resolve_batch(batch_size, mesh)
    check_parallel(model, mesh, seq_len=seq_len, batch_size=batch_size)
    if cfg.max_batches < 0 or (cfg.max_batches == 0 and jax.process_count() > 1):
        raise ValueError(f"--max-batches ({cfg.max_batches}) must be positive (0: all, on one process only)")
    steps = checkpoint_steps(cfg, where)
    task = _passkey_setup(cfg, record, tokenizer["path"], data_cfg, seq_len) if cfg.task == "passkey" else None
    if cfg.harness_task is not None and task is None:
        raise ValueError(f"--harness-task {cfg.harness_task} writes the passkey samples; add --task passkey")
    pool, _ = memory_pool(run_memory_fraction(cfg, record), os.environ)
    meta = {"seq_len": seq_len, "batch_size": batch_size, "data": what, "mesh": dict(mesh.shape),
            "run_mesh": record.get("mesh"), "memory_fraction": pool}
    model, doc_limit = _documents_bound(model, mesh, data_cfg, seq_len, batch_size, cfg.max_batches or None, task)
    graphdef, target = abstract_state(model, mesh)  # parameters only: the optimizer state is not read
    eval_step = make_eval_step(graphdef, mesh, state_shardings(target["params"]))
    token_step = make_token_step(graphdef, mesh, state_shardings(target["params"])) if cfg.by_position or task \
        else None
    by_step, passkeys, result = [], [], {}
    for step in steps:
        checkpointer = Checkpointer(run_dir, keep=10**6, create=False)
        try:
            state, _ = checkpointer.restore(step, target, params_only=True)
        finally:
            checkpointer.close()
        result = evaluate_loss(eval_step, state["params"], data_cfg, mesh, seq_len=seq_len, batch_size=batch_size,
                               max_batches=cfg.max_batches or None, doc_limit=doc_limit)
        result = {"step": step, **result, **meta, "time": runconfig.now()}
        result["written_to"] = str(log_eval(run_dir, result))
        if cfg.by_position:
            pos = position.loss_by_position(token_step, state["params"], data_cfg, mesh, seq_len=seq_len,
                                            batch_size=batch_size, max_batches=cfg.max_batches or None,
                                            doc_limit=doc_limit)
            by_step.append({"step": step, **pos})
        if task is not None:
            passkeys.append({"step": step, **passkey_eval.run_passkey(token_step, state["params"], mesh, **task,
                                                                       seq_len=seq_len, batch_size=batch_size,
                                                                       doc_limit=doc_limit)})
            result["passkey"] = passkeys[-1]
    if jax.process_index() == 0:
        _write_extras(cfg, run_dir, result, by_step, passkeys, meta)
        if task is not None and cfg.harness_task is not None:
            result["passkey"]["harness_task"] = str(_harness_task(cfg.harness_task, task, tokenizer["path"]))
    return result


def _harness_task(folder: str, task: dict, tokenizer_path) -> pathlib.Path:
    from ulysses_jax.data.tokenizers import make_tokenizer
    from ulysses_jax.evaluation import passkey
    from ulysses_jax.evaluation.harness_task import write_lm_eval_task

    samples = [(passkey.build_sample(task["fmt"], task["filler"], length=n, depth=d, index=i, seed=task["seed"],
                                     digits=task["digits"]), n, d)
               for n in task["lengths"] for d in task["depths"] for i in range(task["samples"])]
    return write_lm_eval_task(folder, samples, make_tokenizer(tokenizer_path).decode)


def checkpoint_steps(cfg: EvalConfig, where) -> list[int]:
    """The checkpoints to evaluate: ``--steps`` ("100,200,last"), else ``--step``, else the latest."""
    none = f"no checkpoint in {where.checkpoints}; train first or pass the --run-dir of a run"
    if cfg.steps is None:
        return [where.pick_step(cfg.step, none=none)]
    out = []
    for item in passkey_eval.parse_list(cfg.steps, "--steps", str):
        if item != "last" and not item.isdigit():
            raise ValueError(f"--steps {cfg.steps!r}: {item!r} is neither a step number nor 'last'; e.g. 100,200,last")
        out.append(where.pick_step(None if item == "last" else int(item), none=none, flag="--steps"))
    return sorted(set(out))


def _passkey_setup(cfg: EvalConfig, record: dict, tokenizer_path, data_cfg, seq_len: int) -> dict:
    """The passkey settings, checked before any checkpoint is read: ``run_passkey``'s keyword arguments."""
    fmt, _ = passkey_eval.prompt_format(record, tokenizer_path)
    depths = passkey_eval.parse_list(cfg.depths, "--depths", float)
    fixed = fmt.fixed_tokens(cfg.passkey_digits) if 1 <= cfg.passkey_digits <= 18 else 0
    lengths = passkey_eval.parse_list(cfg.lengths, "--lengths") if cfg.lengths is not None else \
        passkey_eval.default_lengths(seq_len, fixed)
    passkey_eval.check_settings(lengths, depths, cfg.samples, cfg.passkey_digits, seq_len)
    for n in lengths:
        if n < fixed:
            raise ValueError(f"--lengths {n} is too short for a passkey sample (at least {fixed} tokens with this "
                             f"tokenizer); choose longer lengths")
    filler = passkey_eval.filler_tokens(fmt, cfg.passkey_filler, data_cfg, max(lengths), row=seq_len)
    return dict(fmt=fmt, filler=filler, lengths=lengths, depths=depths, samples=cfg.samples, seed=cfg.seed,
                digits=cfg.passkey_digits)


def _documents_bound(model, mesh, data_cfg, seq_len: int, batch_size: int, max_batches, task):
    """``(model, bound)``: with cuDNN's packed attention, the bound on documents per row raised to what this eval's
    rows hold (its eval batches and passkey rows, counted before anything compiles), so eval never meets a row it
    cannot describe; ``(model, None)`` for every other kernel."""
    limit = documents_limit(model, mesh, seq_len)
    if not limit:
        return model, None
    need = max((int(documents_per_row(b["segment_ids"]).max(initial=0)) for b in
                eval_batches(data_cfg, seq_len=seq_len, global_batch=batch_size, max_batches=max_batches)), default=0)
    if task is not None:
        rows = passkey_eval.passkey_rows(**task, seq_len=seq_len)[2]
        need = max(need, int(documents_per_row(rows["segment_ids"]).max(initial=0)))
    if jax.process_count() > 1:  # each process counted its own rows: every one must compile the same bound
        from jax.experimental import multihost_utils

        need = int(np.max(multihost_utils.process_allgather(np.int32(need))))
    if need <= limit:
        return model, limit
    return dataclasses.replace(model, attn_max_documents=need), need


def eval_mesh(given: MeshConfig, record: dict) -> MeshConfig:
    """The mesh to evaluate on: the ``--mesh.*`` flags when any is given; else the run's own mesh when it has as many
    devices as this job, else the default (the terminal names the mesh either way)."""
    if given != MeshConfig():
        return given
    recorded = record.get("mesh") or {}
    if recorded and jax.device_count() == int(np.prod([recorded.get(a, 1) for a in ("data", "fsdp", "ring", "sp")])):
        return MeshConfig(**{a: int(recorded.get(a, 1)) for a in ("data", "fsdp", "ring", "sp")})
    return given


def run_memory_fraction(cfg: EvalConfig, record: dict | None) -> float | None:
    """``--memory-fraction``, else the pool the run trained in (its record's ``memory_pool``), else None."""
    if cfg.memory_fraction is not None:
        return cfg.memory_fraction
    return ((record or {}).get("memory_pool") or {}).get("fraction")


def _write_extras(cfg: EvalConfig, run_dir: pathlib.Path, result: dict, by_step: list[dict], passkeys: list[dict],
                  meta) -> None:
    name = run_dir.resolve().name
    if by_step:
        path = position.write_result(run_dir, by_step, meta)
        result["by_position"] = {"json": str(path), "buckets": by_step[-1]["buckets"], "loss": by_step[-1]["loss"]}
        if cfg.plot:
            result["by_position"]["png"] = str(plots.plot_by_position(
                by_step, run_dir / "eval_by_position.png", title=f"{name}: held-out loss by position"))
    if passkeys:
        pk = result["passkey"]
        # every checkpoint's table, each entry naming its step; "step" (top level) is the last one, which the PNG shows
        results = [{**r, "step": one["step"]} for one in passkeys for r in one["results"]]
        out = {"step": result["step"], "results": results, "seed": cfg.seed, "digits": cfg.passkey_digits,
               "filler": cfg.passkey_filler, "rows": pk["rows"], **meta}
        pk["json"] = str(passkey_eval.write_result(run_dir, out))
        if cfg.plot:
            pk["png"] = str(plots.plot_passkey(pk["results"], run_dir / "eval_passkey.png",
                                                    title=f"{name}: passkey accuracy at step {result['step']}"))
