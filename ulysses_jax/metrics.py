"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step), TensorBoard event files, a progress bar.

Only process 0 writes. ``metrics.jsonl`` is appended to, so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
from tqdm.auto import tqdm


def peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPUs do, CPUs do not)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without the call
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


class MetricsLogger:
    def __init__(self, run_dir: str | pathlib.Path, *, total_steps: int, first_step: int = 0, progress: bool = True):
        self.enabled = jax.process_index() == 0
        self.run_dir = pathlib.Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tb_dir = self.run_dir / "tensorboard"
        self._file = self._tb = self._bar = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.jsonl_path.open("a")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self.tb_dir), flush_secs=10)
        if progress:
            self._bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"train/{key}", value, step)
        if self._bar is not None:
            shown = {"loss": f"{record['loss']:.4f}"}
            if record.get("tokens_per_s"):
                shown["tok/s"] = f"{record['tokens_per_s']:,.0f}"
            if record.get("mfu") is not None:
                shown["mfu"] = f"{100 * record['mfu']:.1f}%"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

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
