"""Checkpoints with Orbax: train state, data-iterator state and run metadata, asynchronous, keep-last-N.

Layout of a run directory::

    run_dir/run.json            what the run is (model config, sequence length, vocabulary): a resume
                                into a directory written by a different run is refused
    run_dir/checkpoints/<step>/ one Orbax checkpoint: ``state`` (params, optimizer state, step, RNG,
                                sharded arrays), ``data`` (the Grain iterator state, JSON)

Orbax writes each step into a temporary directory and renames it when complete, so a save cut short by
a kill is never listed as a step: ``latest_step`` only ever returns finished checkpoints. Restoring with
an abstract target that carries shardings lays the arrays out on the *current* mesh, so a run saved
with ``sp=4`` resumes on ``fsdp=4 x sp=2``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, run_dir: str | pathlib.Path, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep_checkpoints ({keep}) must be at least 1")
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
        self.manager.save(step, args=args)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore ``step`` onto the shardings carried by ``abstract_state`` (ShapeDtypeStructs)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 - any failure here means the files are not a usable checkpoint
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(
                f"checkpoint {self.directory / str(step)} cannot be restored ({type(e).__name__}: {reason}); "
                f"it is corrupt or from an incompatible run: move it away to resume from an earlier step"
            ) from e
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def check_run_dir(run_dir: str | pathlib.Path, identity: dict, *, resume: bool) -> None:
    """Refuse to mix runs: raises ``ValueError`` with the fix; writes ``run.json`` for a new run.

    ``identity``: what must match for a resume (JSON-serialisable: model config, sequence length, ...).
    """
    run_dir = pathlib.Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file; choose a directory path with --run-dir")
    ckpt_dir = run_dir / "checkpoints"
    has_ckpts = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    run_file = run_dir / "run.json"
    if resume:
        if not has_ckpts:
            raise ValueError(
                f"--resume: no checkpoint in {ckpt_dir}; start without --resume, or point --run-dir at a run"
            )
        if run_file.exists():
            saved = json.loads(run_file.read_text())
            diffs = [k for k in sorted(set(saved) | set(identity)) if saved.get(k) != identity.get(k)]
            if diffs:
                k = diffs[0]
                raise ValueError(
                    f"run directory {run_dir} holds another run's checkpoints ({k}: saved {saved.get(k)!r}, "
                    f"requested {identity.get(k)!r}); resume with the same settings or choose a new --run-dir"
                )
        return
    if has_ckpts:
        raise ValueError(
            f"run directory {run_dir} already holds checkpoints; pass --resume to continue that run "
            f"or choose a new --run-dir (nothing was overwritten)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        run_file.write_text(json.dumps(identity, indent=1, sort_keys=True))
