"""Checkpoints with Orbax: train state, data-iterator state and run metadata, asynchronous, keep-last-N.

Layout of a run directory::

    run_dir/run.json            what the run is (model config, sequence length, vocabulary): a resume
                                into a directory written by a different run is refused
    run_dir/checkpoints/<step>/ one Orbax checkpoint: ``params`` and ``train`` (optimizer state, step,
                                RNG): sharded arrays; ``data``: every process's Grain iterator state,
                                as JSON keyed by process index. ``eval`` restores ``params`` alone.

Orbax writes each step into a temporary directory and renames it when complete, so a save cut short by
a kill is never listed as a step: ``latest_step`` only ever returns finished checkpoints. Restoring with
an abstract target that carries shardings lays the arrays out on the *current* mesh, so a run saved
with ``sp=4`` resumes on ``fsdp=4 x sp=2``.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


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

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices.

        ``state``: the train state dict (``params`` and the rest); ``data_state``: this process's
        iterator state (JSON-serialisable). Every process must call it.
        """
        train = {k: v for k, v in state.items() if k != "params"}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            train=ocp.args.StandardSave(train),
            data=ocp.args.JsonSave(_all_processes(data_state)),
        )
        self.manager.save(step, args=args)

    def restore(self, step: int, abstract_state: dict, *, params_only: bool = False) -> tuple[dict, dict | None]:
        """Restore ``step`` onto the shardings carried by ``abstract_state`` (ShapeDtypeStructs).

        Returns ``(state, this process's data state)``; with ``params_only``, ``({"params": ...}, None)``.
        """
        items = {"params": ocp.args.StandardRestore(abstract_state["params"])}
        if not params_only:
            train = {k: v for k, v in abstract_state.items() if k != "params"}
            items.update(train=ocp.args.StandardRestore(train), data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - any failure here means the files are not a usable checkpoint
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(
                f"checkpoint {self.directory / str(step)} cannot be restored ({type(e).__name__}: {reason}); "
                f"it is corrupt or from an incompatible run: move it away to resume from an earlier step"
            ) from e
        if params_only:
            return {"params": restored["params"]}, None
        data = restored["data"].get(str(jax.process_index()))
        if data is None:
            raise ValueError(
                f"checkpoint {self.directory / str(step)} holds data-iterator states for processes "
                f"{sorted(restored['data'])} but this is process {jax.process_index()}: resume with the same "
                f"number of processes ({len(restored['data'])})"
            )
        return {"params": restored["params"], **restored["train"]}, data

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _all_processes(state: dict) -> dict[str, dict]:
    """``{process_index: state}`` for every process (Orbax writes JSON from the primary process only)."""
    if jax.process_count() == 1:
        return {"0": state}
    raw = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([raw.size]))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    every = multihost_utils.process_allgather(padded)
    return {str(i): json.loads(bytes(every[i][: int(lengths[i][0])]).decode()) for i in range(jax.process_count())}


def check_run_dir(run_dir: str | pathlib.Path, identity: dict, *, resume: bool) -> None:
    """Refuse to mix runs: raises ``ValueError`` with the fix; writes ``run.json`` for a new run.

    ``identity``: what must match for a resume (JSON-serialisable: model config, sequence length, ...);
    its ``"compute"`` entry (how steps are computed: attention, remat, chunks, dtype) is recorded for
    ``eval`` but free to change on resume.
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
            try:
                saved = json.loads(run_file.read_text())
            except ValueError:
                raise ValueError(
                    f"{run_file} is not valid JSON: the run record is damaged; restore it or start a new --run-dir"
                ) from None
            keys = sorted((set(saved) | set(identity)) - {"compute"})
            diffs = [k for k in keys if saved.get(k) != identity.get(k)]
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
