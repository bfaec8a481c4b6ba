"""The training loop: ``train_run`` runs a set-up job (``Run``, made by ``trainer.setup_train``) to its last step.

Each step: the next global batch (this process's rows checked against cuDNN's document bound on every process alike),
the jitted step, the metrics logged (MFU counting each document's attention apart), evaluation and checkpoints at
their intervals. It stops cleanly on SIGTERM or SIGINT (``signals.py``): the step under way finishes, a checkpoint is
written and the summary says ``stopped_by``. A non-finite loss, gradient norm or parameter stops without saving
(``divergence.py``), naming the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import signal
import time

import jax

from ulysses_jax.data.documents import DataConfig
from ulysses_jax.data.pipeline import BatchIterator, check_documents_per_row, merge_states, to_global
from ulysses_jax.kernels.attention import device_platform
from ulysses_jax.model import flops
from ulysses_jax.model.config import ModelConfig
from ulysses_jax.train import cluster
from ulysses_jax.train.checkpoint import Checkpointer, gather
from ulysses_jax.train.config import TrainConfig
from ulysses_jax.train.devices import documents_limit
from ulysses_jax.train.divergence import all_finite, diverged
from ulysses_jax.train.eval_loss import evaluate_loss
from ulysses_jax.train.metrics import MetricsLogger, moe_metrics, peak_memory_bytes
from ulysses_jax.train.signals import _StopSignals


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
    batch_size: int = 2
    record: dict = dataclasses.field(default_factory=dict)
    summary: str = ""  # what validate_sources found
    notes: list[str] = dataclasses.field(default_factory=list)  # what the user should know before the run starts
    eval_step: object = None
    data_config: DataConfig | None = None
    loop_eval: object = None  # --eval-by-position / --eval-passkey: .metrics(params) (evaluation/loop.py)

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.cfg.run_dir)


def _save(run: Run, step: int, state: dict) -> None:
    run.checkpointer.save(step, state, merge_states(gather(run.data.get_state())))


def train_run(run: Run) -> dict:
    cfg, mesh = run.cfg, run.mesh
    n_dev = mesh.devices.size
    log = MetricsLogger(cfg.run_dir, total_steps=cfg.steps, first_step=run.start_step, progress=cfg.progress,
                        wandb_project=cfg.wandb_project, wandb_id=run.record.get("wandb_id"),
                        config=run.record.get("config"))
    state, losses, times, evals = run.state, [], [], []
    doc_limit = documents_limit(run.model, mesh, cfg.seq_len)
    last_saved = run.start_step if run.start_step else None
    stopped_by, step = None, run.start_step
    signals = _StopSignals().__enter__()  # until the last save is written (checkpointer.close() below)
    try:
        for step in range(run.start_step, cfg.steps):
            if run.profile and step == run.profile[0]:
                jax.profiler.start_trace(str(pathlib.Path(cfg.run_dir) / "profile"))
            local = next(run.data)
            # this process's rows (one id for two runs; beyond cuDNN's bound), refused on every process alike
            cluster.decide_together(check_documents_per_row, local, doc_limit, rows=run.data.row_ids)
            batch = to_global(local, mesh, global_batch=run.data.global_batch, row_ids=run.data.row_ids)
            step_flops = flops.batch_flops_per_device(run.model, local["segment_ids"], n_devices=n_dev,
                                                      global_batch=run.batch_size)  # each document apart
            t0 = time.perf_counter()
            state, metrics = run.step_fn(state, batch)
            loss = float(metrics["loss"])  # waits for the step
            dt = time.perf_counter() - t0
            if run.profile and step + 1 == run.profile[1]:
                jax.profiler.stop_trace()
            grad_norm = float(metrics["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the update took a non-finite gradient
                what = f"loss is {loss}" if not math.isfinite(loss) else f"the gradient's norm is {grad_norm}"
                raise diverged(f"{what} at step {step + 1}", last_saved, run.checkpointer.directory)
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": float(metrics["lr"]),
                "tokens": int(metrics["tokens"]),
                "step_time_s": dt,
                "tokens_per_s": run.batch_size * cfg.seq_len / dt,
                "mfu": flops.mfu(step_flops, dt, run.peak) if run.peak else None,
                "peak_memory_bytes": peak_memory_bytes(),
            }
            if "expert_load" in metrics:  # experts: the load-balancing loss and the tokens each expert took
                record.update(moe_metrics(metrics))
            if step == run.start_step and run.planned_bytes is not None and device_platform(mesh) == "gpu":
                # validates the planner: XLA's buffers (what `plan` predicts) beside the allocator's measured peak
                record["planned_bytes"] = run.planned_bytes
                measured = record["peak_memory_bytes"]
                log.write(f"memory per device: planned {run.planned_bytes / 2**30:.2f} GiB (XLA buffers, as "
                          f"`ulysses-jax plan` reports), measured peak "
                          f"{'n/a' if measured is None else f'{measured / 2**30:.2f} GiB'}")
            if run.eval_step is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                ev = evaluate_loss(run.eval_step, state["params"], run.data_config, mesh, seq_len=cfg.seq_len,
                                   batch_size=run.batch_size, max_batches=cfg.eval_batches, doc_limit=doc_limit)
                record.update({f"eval_{k}": v for k, v in ev.items()})
                record.update(run.loop_eval.metrics(state["params"]) if run.loop_eval else {})
                evals.append((step + 1, ev["loss"]))
            log.log(record)
            losses.append(loss)
            times.append(dt)
            stop = signals.stop()
            if stop or (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                if not bool(all_finite(state["params"])):  # a finite gradient times the rate can overflow
                    raise diverged(f"the parameters are not finite after step {step + 1}", last_saved,
                                   run.checkpointer.directory)
                _save(run, step + 1, state)
                last_saved = step + 1
            if stop and step + 1 < cfg.steps:  # (a stop at the last step: the run is done, exit 0)
                stopped_by = signal.Signals(signals.signum).name if signals.signum else "another process"
                break
    except BaseException as e:
        cluster.failing(e)  # a multi-process job: the other processes are told now, not after the cleanup below
        raise
    finally:
        run.checkpointer.close()  # a first signal meanwhile waits for the save: the handlers go after it
        signals.__exit__()
        log.close()
    steady = times[1:] or times  # the first step compiles
    return {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": len(losses),
        "last_step": run.start_step + len(losses),
        "tokens_per_s": run.batch_size * cfg.seq_len * len(steady) / sum(steady) if steady else None,
        "checkpoints": str(pathlib.Path(cfg.run_dir) / "checkpoints"),
        "metrics": str(log.jsonl_path),
        "tensorboard": str(log.tb_dir),
        "losses": losses,
        "evals": evals,
        "stopped_by": stopped_by,
    }
