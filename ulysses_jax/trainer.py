"""The training and evaluation jobs (the step itself is ``step.py``): configuration, the loop, checkpoints, metrics.

``train(TrainConfig(...))`` and ``evaluate(EvalConfig(...))`` are what ``ulysses-jax train`` and
``ulysses-jax eval`` run (the CLI flags are generated from these dataclasses). Everything the user can
get wrong is checked in ``setup_*`` before anything is written or computed, with a ``ValueError`` that
names the value and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Literal

import jax
import numpy as np

from ulysses_jax import flops
from ulysses_jax.checkpoint import Checkpointer, check_run_dir
from ulysses_jax.attention import device_platform, resolve_impl
from ulysses_jax.config import ModelConfig, RopeScaling, local_chunks
from ulysses_jax.data import BatchIterator, DataConfig, eval_batches, to_global
from ulysses_jax.mesh import make_mesh
from ulysses_jax.metrics import MetricsLogger, peak_memory_bytes
from ulysses_jax.step import (
    BATCH_KEYS,
    OptimConfig,
    abstract_state,
    batch_sharding,
    init_state,
    make_eval_step,
    make_optimizer,
    make_schedule,
    make_train_step,
    state_shardings,
)

# Model fields that change how a step is computed, not what is learned: free to differ on resume.
COMPUTE_ONLY = ("attention_impl", "remat", "loss_chunk", "mlp_chunk", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # replicas
    fsdp: int = -1  # batch and parameter sharding; -1: the remaining devices
    sp: int = 1  # Ulysses sequence parallelism (innermost: devices of one host)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"  # model preset (ModelConfig.from_preset)
    steps: int = 200  # total optimizer steps (a resumed run continues up to this count)
    seq_len: int = 4096  # tokens per row (the context length)
    batch_size: int = 2  # rows per global batch
    grad_accum: int = 1  # micro-batches per step (normalised by tokens, not by micro-batches)
    mesh: MeshConfig = MeshConfig()
    attention: Literal["auto", "xla", "pallas", "cudnn"] = "auto"  # attention implementation
    remat: Literal["none", "full", "save_matmuls", "offload"] | None = None  # None: the preset's
    loss_chunk: int | None = None  # tiled loss chunk in tokens (0: off; None: the preset's)
    mlp_chunk: int | None = None  # tiled MLP chunk in tokens (0: off; None: the preset's)
    optim: OptimConfig = OptimConfig()
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl, tensorboard/
    resume: bool = False  # continue from the latest checkpoint in run_dir
    checkpoint_every: int = 50  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3  # checkpoints kept (the oldest are deleted)
    seed: int = 0  # parameter init and data order
    data: tuple[str, ...] = ()  # text/jsonl/parquet files or directories; none: the built-in corpus
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; none: bytes
    profile_steps: str | None = None  # "A:B": write a jax.profiler trace of steps A..B-1 to run_dir/profile
    peak_tflops: float | None = None  # per-device peak for MFU (default: known GPUs' bf16 dense peak)
    progress: bool = True  # show a progress bar
    cpu_devices: int = 8  # fake CPU devices when there is no accelerator
    distributed: bool = False  # multi-host: call jax.distributed.initialize() (cluster settings auto-detected)
    coordinator_address: str | None = None  # multi-host without a cluster manager: "host:port" of process 0
    num_processes: int | None = None  # ... with the number of processes
    process_id: int | None = None  # ... and this process's index


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    run_dir: str = "runs/default"  # the run to evaluate (its latest checkpoint)
    mesh: MeshConfig = MeshConfig()
    batch_size: int = 2  # rows per batch
    max_batches: int = 16  # held-out batches to read (0: all)
    attention: Literal["auto", "xla", "pallas", "cudnn"] = "auto"
    data: tuple[str, ...] = ()  # as for training: held-out documents come from the same sources
    tokenizer: str | None = None
    cpu_devices: int = 8
    distributed: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


# ------------------------------------------------------------------------------------ setup


def _model_config(preset: str, vocab_size: int, **overrides) -> ModelConfig:
    cfg = ModelConfig.from_preset(preset, **{k: v for k, v in overrides.items() if v is not None})
    if vocab_size > cfg.vocab_size:
        if preset != "tiny":
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but preset {preset!r} has a vocabulary of "
                f"{cfg.vocab_size}; use that model's own tokenizer"
            )
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return cfg


def check_parallel(cfg: ModelConfig, mesh, *, seq_len: int, batch_size: int, grad_accum: int = 1) -> None:
    data, fsdp, sp = (mesh.shape[a] for a in ("data", "fsdp", "sp"))
    if seq_len < 1 or seq_len % sp:
        raise ValueError(f"--seq-len ({seq_len}) must be a positive multiple of --mesh.sp ({sp})")
    if sp > cfg.num_heads:
        raise ValueError(
            f"--mesh.sp ({sp}) exceeds the model's query heads ({cfg.num_heads}): Ulysses splits heads over sp; "
            f"use --mesh.sp <= {cfg.num_heads}"
        )
    rows = data * fsdp
    if batch_size < 1 or batch_size % grad_accum or (batch_size // grad_accum) % rows:
        raise ValueError(
            f"--batch-size ({batch_size}) must be a multiple of --grad-accum ({grad_accum}) x data x fsdp "
            f"({data} x {fsdp}) = {grad_accum * rows}"
        )
    hosts = len({d.process_index for d in mesh.devices.flat})  # the mesh's, so a planned topology counts too
    per_host = mesh.devices.size // hosts
    if batch_size % hosts:
        raise ValueError(f"--batch-size ({batch_size}) must be divisible by the {hosts} processes (hosts)")
    if hosts > 1 and per_host % sp:
        raise ValueError(
            f"--mesh.sp ({sp}) must divide the {per_host} devices of each host, so that an sp group stays within "
            f"one host; use --mesh.sp <= {per_host}"
        )
    for flag, chunk in (("--loss-chunk", cfg.loss_chunk), ("--mlp-chunk", cfg.mlp_chunk)):
        if chunk:
            local_chunks(chunk, seq_len // sp, flag)
    # training rows are packed documents, so segment ids are always present
    resolve_impl(cfg.attention_impl, dtype=cfg.compute_jnp_dtype, head_dim=cfg.head_dim, has_segment_ids=True,
                 platform=device_platform(mesh))


def run_identity(cfg: ModelConfig, seq_len: int, tokenizer: str | None, optim: OptimConfig) -> dict:
    fields = dataclasses.asdict(cfg)
    model = {k: v for k, v in fields.items() if k not in COMPUTE_ONLY}
    # the optimizer-state tree differs with and without clipping: a resume must keep that choice
    return {"model": model, "seq_len": seq_len, "tokenizer": tokenizer,
            "optimizer": "adamw+clip" if optim.clip_norm else "adamw",
            "compute": {k: fields[k] for k in COMPUTE_ONLY}}


def model_config_from_run(run_dir: pathlib.Path) -> tuple[ModelConfig, dict]:
    path = run_dir / "run.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: {run_dir} is not a training run directory; pass --run-dir of a run")
    try:
        identity = json.loads(path.read_text())
        fields = {**identity["model"], **identity.get("compute", {})}
        if fields.get("rope_scaling"):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return ModelConfig(**fields), identity
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a readable ulysses-jax run record ({type(e).__name__}: {e}); "
            f"pass the --run-dir of a run written by `ulysses-jax train`"
        ) from None


def _peak(cfg_peak_tflops: float | None) -> float | None:
    if cfg_peak_tflops is not None:
        if cfg_peak_tflops <= 0:
            raise ValueError(f"--peak-tflops ({cfg_peak_tflops}) must be positive")
        return cfg_peak_tflops * 1e12
    return flops.peak_flops(jax.devices()[0].device_kind)


def _profile_range(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {spec!r} must look like A:B (two step numbers, A < B)") from None
    if not 0 <= a < b:
        raise ValueError(f"--profile-steps {spec!r} must look like A:B with 0 <= A < B")
    return a, b


@dataclasses.dataclass
class Run:
    cfg: TrainConfig
    model: ModelConfig
    mesh: jax.sharding.Mesh
    data: BatchIterator
    checkpointer: Checkpointer
    start_step: int
    state: dict
    step_fn: object
    peak: float | None
    profile: tuple[int, int] | None
    planned_bytes: int | None = None  # XLA's per-device total of the compiled step (what `plan` reports)


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The model a ``TrainConfig`` trains: its preset with the memory tools and attention of the flags."""
    return _model_config(
        cfg.preset, vocab_size, attention_impl=cfg.attention, remat=cfg.remat,
        loss_chunk=cfg.loss_chunk, mlp_chunk=cfg.mlp_chunk,
    )


def setup_train(cfg: TrainConfig) -> Run:
    """Validate everything and build (or restore) the state; raises ValueError on user error."""
    if cfg.steps < 1 or cfg.checkpoint_every < 1:
        raise ValueError(f"--steps ({cfg.steps}) and --checkpoint-every ({cfg.checkpoint_every}) must be >= 1")
    mesh = make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, sp=cfg.mesh.sp)
    data_cfg = DataConfig(paths=tuple(cfg.data), tokenizer=cfg.tokenizer)
    it = BatchIterator(data_cfg, seq_len=cfg.seq_len, global_batch=cfg.batch_size, seed=cfg.seed)
    model = model_config(cfg, it.vocab_size)
    check_parallel(model, mesh, seq_len=cfg.seq_len, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
    peak, profile = _peak(cfg.peak_tflops), _profile_range(cfg.profile_steps)
    check_run_dir(cfg.run_dir, run_identity(model, cfg.seq_len, cfg.tokenizer, cfg.optim), resume=cfg.resume)
    tx = make_optimizer(cfg.optim, cfg.steps)
    checkpointer = Checkpointer(cfg.run_dir, keep=cfg.keep_checkpoints)
    start = 0
    if cfg.resume:
        start = checkpointer.latest_step()
        graphdef, target = abstract_state(model, mesh, tx, cfg.seed)
        state, data_state = checkpointer.restore(start, target)
        it.set_state(data_state)
        if start >= cfg.steps:
            raise ValueError(f"--resume: the run is already at step {start} of --steps {cfg.steps}; raise --steps")
    else:
        graphdef, state = init_state(model, mesh, tx, cfg.seed)
    step_fn = make_train_step(
        graphdef, tx, make_schedule(cfg.optim, cfg.steps), mesh, state_shardings(state), grad_accum=cfg.grad_accum
    )
    # Compiled ahead of the loop: the same program `ulysses-jax plan` compiles, so its memory figure is the plan's.
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), np.int32, sharding=batch_sharding(mesh))
             for k in BATCH_KEYS}
    step_fn = step_fn.lower(state, batch).compile()
    mem = step_fn.memory_analysis()
    return Run(cfg, model, mesh, it, checkpointer, start, state, step_fn, peak, profile, device_total_bytes(mem))


# ------------------------------------------------------------------------------------ the loop


def device_total_bytes(mem) -> int | None:
    """XLA's per-device memory of a compiled program: argument + output + temp - alias (``memory_analysis()``)."""
    if mem is None:
        return None
    return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes


class TrainingDiverged(RuntimeError):
    pass


def train(cfg: TrainConfig) -> dict:
    """Run the training job; returns a summary (first/last loss, tokens/s, paths)."""
    return train_run(setup_train(cfg))


def train_run(run: Run) -> dict:
    cfg, mesh = run.cfg, run.mesh
    n_dev = mesh.devices.size
    step_flops = flops.flops_per_device(run.model, batch=cfg.batch_size, seq_len=cfg.seq_len, n_devices=n_dev)
    log = MetricsLogger(cfg.run_dir, total_steps=cfg.steps, first_step=run.start_step, progress=cfg.progress)
    state, losses, times = run.state, [], []
    last_saved = run.start_step if cfg.resume else None
    try:
        for step in range(run.start_step, cfg.steps):
            if run.profile and step == run.profile[0]:
                jax.profiler.start_trace(str(pathlib.Path(cfg.run_dir) / "profile"))
            batch = to_global(next(run.data), mesh)
            t0 = time.perf_counter()
            state, metrics = run.step_fn(state, batch)
            loss = float(metrics["loss"])  # waits for the step
            dt = time.perf_counter() - t0
            if run.profile and step + 1 == run.profile[1]:
                jax.profiler.stop_trace()
            if not math.isfinite(loss):
                where = f"step {last_saved}" if last_saved is not None else "none yet"
                raise TrainingDiverged(
                    f"loss is {loss} at step {step + 1}; stopped without saving (last good checkpoint: {where}); "
                    f"lower --optim.lr or raise --optim.warmup-steps and resume"
                )
            n_tok = int(metrics["tokens"])
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": float(metrics["grad_norm"]),
                "lr": float(metrics["lr"]),
                "tokens": n_tok,
                "step_time_s": dt,
                "tokens_per_s": cfg.batch_size * cfg.seq_len / dt,
                "mfu": flops.mfu(step_flops, dt, run.peak) if run.peak else None,
                "peak_memory_bytes": peak_memory_bytes(),
            }
            if step == run.start_step and run.planned_bytes is not None and device_platform(mesh) == "gpu":
                # validates the planner: XLA's buffers (what `plan` predicts) beside the allocator's measured peak
                record["planned_bytes"] = run.planned_bytes
                measured = record["peak_memory_bytes"]
                log.write(f"memory per device: planned {run.planned_bytes / 2**30:.2f} GiB (XLA buffers, as "
                          f"`ulysses-jax plan` reports), measured peak "
                          f"{'n/a' if measured is None else f'{measured / 2**30:.2f} GiB'}")
            log.log(record)
            losses.append(loss)
            times.append(dt)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                run.checkpointer.save(step + 1, state, run.data.get_state())
                last_saved = step + 1
    finally:
        run.checkpointer.close()
        log.close()
    steady = times[1:] or times  # the first step compiles
    return {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": len(losses),
        "tokens_per_s": cfg.batch_size * cfg.seq_len * len(steady) / sum(steady) if steady else None,
        "checkpoints": str(run.checkpointer.directory),
        "metrics": str(log.jsonl_path),
        "tensorboard": str(log.tb_dir),
        "losses": losses,
    }


# ------------------------------------------------------------------------------------ eval


def evaluate(cfg: EvalConfig) -> dict:
    """Loss and perplexity of the run's latest checkpoint on held-out documents, with SP on."""
    run_dir = pathlib.Path(cfg.run_dir)
    model, identity = model_config_from_run(run_dir)  # with the run's compute settings (dtype, chunks, ...)
    model = dataclasses.replace(model, attention_impl=cfg.attention)
    seq_len = identity["seq_len"]
    tokenizer = cfg.tokenizer if cfg.tokenizer is not None else identity.get("tokenizer")
    mesh = make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, sp=cfg.mesh.sp)
    check_parallel(model, mesh, seq_len=seq_len, batch_size=cfg.batch_size)
    checkpointer = Checkpointer(run_dir, keep=10**6)
    step = checkpointer.latest_step()
    if step is None:
        raise ValueError(f"no checkpoint in {checkpointer.directory}; train first or pass the --run-dir of a run")
    graphdef, target = abstract_state(model, mesh)  # parameters only: the optimizer state is not read
    state, _ = checkpointer.restore(step, target, params_only=True)
    checkpointer.close()
    eval_step = make_eval_step(graphdef, mesh, state_shardings(state["params"]))
    data_cfg = DataConfig(paths=tuple(cfg.data), tokenizer=tokenizer)
    total, count, batches = 0.0, 0, 0
    for local in eval_batches(data_cfg, seq_len=seq_len, global_batch=cfg.batch_size,
                              max_batches=cfg.max_batches or None):
        s, c = eval_step(state["params"], to_global(local, mesh))
        total, count, batches = total + float(s), count + int(c), batches + 1
    if count == 0:
        raise ValueError("no held-out tokens to evaluate: the data has too few documents for an eval split")
    loss = total / count
    return {"step": step, "loss": loss, "perplexity": float(np.exp(loss)), "tokens": count, "batches": batches,
            "seq_len": seq_len}
