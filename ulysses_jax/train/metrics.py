"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard events, a progress bar, and
optionally Weights & Biases.

Only process 0 writes. A run that continues from step ``s`` (after a crash, a signal or ``--resume-from``) first drops
the records after ``s`` from ``metrics.jsonl``, tells TensorBoard to hide every earlier event (``purge_step``) and
writes the kept records again: TensorBoard then shows what ``metrics.jsonl`` holds, so no step is ever logged twice or
lost (a killed run's last events may still be in the writer's queue, never written). Evaluation during training
(``eval_*`` keys of a step's record) goes to TensorBoard under ``eval/``; ``log_eval`` records a standalone
``ulysses-jax eval``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys

import jax
from tqdm.auto import tqdm

WANDB_HINT = "--wandb-project needs the wandb package: pip install wandb (then `wandb login`)"


def peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPUs do, CPUs do not)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without the call
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def moe_metrics(metrics: dict) -> dict:
    """A mixture of experts' record fields from a step's metrics: ``aux_loss`` (the load-balancing loss, unweighted),
    ``expert_load`` (top-k assignments per expert, summed over the sparse layers) and ``expert_load_max_over_mean``
    (1.0 = perfectly balanced)."""
    load = [int(n) for n in metrics["expert_load"]]
    mean = sum(load) / max(len(load), 1)
    return {"aux_loss": float(metrics["aux_loss"]), "expert_load": load,
            "expert_load_max_over_mean": max(load) / mean if mean else 0.0}


def check_wandb(project: str | None) -> None:
    if project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_HINT)


def tensorboard_command(tb_dir: str | os.PathLike) -> str:
    """The command that shows ``tb_dir``: the ``tensorboard`` beside this Python when installed, else how to get it."""
    if importlib.util.find_spec("tensorboard") is None:
        return f"pip install tensorboard, then: tensorboard --logdir {tb_dir}"
    here = pathlib.Path(sys.executable).parent / "tensorboard"
    exe = "tensorboard"
    if here.exists() and shutil.which("tensorboard") != str(here):
        try:
            exe = os.path.relpath(here)
        except ValueError:  # another drive
            exe = str(here)
        if exe.startswith(".."):
            exe = str(here)
    return f"{exe} --logdir {tb_dir}"


def _keep_until(path: pathlib.Path, last_step: int) -> None:
    """Drop the records of ``path`` with a step after ``last_step`` (rewritten atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue  # a line cut short by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)


def _chart(key: str) -> str:
    """A record's key as TensorBoard's and W&B's chart: ``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class MetricsLogger:
    """``first_step``: the step the run continues from (0 for a new run): records after it are dropped."""

    def __init__(self, run_dir: str | pathlib.Path, *, total_steps: int, first_step: int = 0, progress: bool = True,
                 wandb_project: str | None = None, wandb_id: str | None = None, config: dict | None = None):
        self.enabled = jax.process_index() == 0
        self.run_dir = pathlib.Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tb_dir = self.run_dir / "tensorboard"
        self._file = self._tb = self._bar = self._wandb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        earlier = any(self.tb_dir.glob("events.out.tfevents.*"))
        _keep_until(self.jsonl_path, first_step)
        self._file = self.jsonl_path.open("a")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self.tb_dir), flush_secs=10, purge_step=1 if earlier else None,
                                 filename_suffix=f".from-step-{first_step}" if earlier else "")
        if earlier:
            self._replay(first_step)
        if wandb_project is not None:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=self.run_dir.name, id=wandb_id, resume="allow",
                                     config=config, dir=str(self.run_dir))
        if progress:
            self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._scalars(record)
        if self._wandb is not None:
            self._wandb.log({_chart(k): v for k, v in record.items() if k != "step" and v is not None}, step=step)
        if self._bar is not None:
            shown = {"loss": f"{record['loss']:.4f}"}
            if record.get("tokens_per_s"):
                shown["tok/s"] = f"{record['tokens_per_s']:,.0f}"
            if record.get("mfu") is not None:
                shown["mfu"] = f"{100 * record['mfu']:.1f}%"
            if record.get("eval_loss") is not None:
                shown["eval"] = f"{record['eval_loss']:.4f}"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def _replay(self, first_step: int) -> None:
        """The events of the kept steps again (the file's purge hides every earlier one): the training records, as
        ``metrics.jsonl`` keeps them (``_keep_until``), and the standalone evaluations of ``eval.jsonl`` up to
        ``first_step``."""
        for line in self.jsonl_path.read_text().splitlines() if self.jsonl_path.exists() else ():
            self._scalars(json.loads(line))
        evals = self.run_dir / "eval.jsonl"
        for line in evals.read_text().splitlines() if evals.exists() else ():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if r.get("step", first_step + 1) <= first_step:
                self._scalars({"step": r["step"], **{f"eval_{k}": r[k] for k in ("loss", "perplexity") if k in r}})

    def _scalars(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(_chart(key), value, record["step"])

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        (self._bar.write if self._bar is not None else print)(message)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def log_eval(run_dir: str | pathlib.Path, result: dict) -> pathlib.Path:
    """Append a standalone evaluation to ``run_dir/eval.jsonl`` and TensorBoard (``eval/``); process 0 only."""
    path = pathlib.Path(run_dir) / "eval.jsonl"
    if jax.process_index() != 0:
        return path
    with path.open("a") as f:
        f.write(json.dumps(result) + "\n")
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard")) as tb:
        for key in ("loss", "perplexity"):
            tb.add_scalar(f"eval/{key}", result[key], result["step"])
    return path
