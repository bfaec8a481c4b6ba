"""Checkpoints with Orbax: train state and data position, asynchronous, keep-last-N.

``run_dir/checkpoints/<step>/`` is one Orbax checkpoint: ``params`` and ``train`` (optimizer state, step, RNG):
sharded arrays; ``data``: the data position of every row of the global batch (``data.BatchIterator``), as JSON.
``eval`` restores ``params`` alone. What the run is (``run.json``) is ``runconfig.py``'s.

Orbax writes each step into a temporary directory and renames it when complete, so a save cut short by a kill is
never listed as a step: ``latest_step`` only ever returns finished checkpoints. Restoring with an abstract target that
carries shardings lays the arrays out on the *current* mesh, so a run saved with ``sp=4`` resumes on ``fsdp=4 x sp=2``.
A checkpoint that cannot be restored is named, and an I/O error (permissions, a failing disk) is told apart from a
damaged or foreign checkpoint.
"""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from ulysses_jax.train import optimizer

_IO_ERRNOS = {errno.EIO, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.ETIMEDOUT, errno.ESTALE,
              errno.EAGAIN, errno.EBUSY, errno.ENOTCONN, errno.EHOSTDOWN, errno.ECONNRESET}
_IO_WORDS = ("PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "Input/output error", "Permission denied",
             "Read-only file system", "No space left", "Stale file handle")


def _io_error(e: BaseException) -> str | None:
    """A short description when ``e`` (or what caused it) is an I/O failure rather than bad contents."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _IO_ERRNOS:
            return f"{e.strerror or type(e).__name__}{': ' + str(e.filename) if e.filename else ''}"
        text = str(e)
        for word in _IO_WORDS:
            if word in text:
                return word
        e = e.__cause__ or e.__context__
    return None


def _tree_mismatch(e: BaseException) -> bool:
    """Whether Orbax refused the restore because the target's tree is not the checkpoint's (its messages in
    orbax-checkpoint 0.12.8: a full restore's, then a partial one's; test_step.py's resume across the optimizer
    state's layouts fails if they change)."""
    return any(words in str(e) for words in ("tree structures do not match", "Type mismatch at key path"))


class Checkpointer:
    """``create=False`` (``eval``): reads only; the checkpoint directory must exist."""

    def __init__(self, run_dir: str | pathlib.Path, *, keep: int = 3, async_save: bool = True, create: bool = True):
        if keep < 1:
            raise ValueError(f"--keep-checkpoints ({keep}) must be at least 1")
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        if not create and not self.directory.is_dir():
            raise ValueError(f"no checkpoint in {self.directory}; train first or pass the --run-dir of a run")
        # a save cut short by a kill leaves its temporary directory: the writer deletes such leftovers at start
        options = ocp.CheckpointManagerOptions(max_to_keep=keep if create else None,
                                               enable_async_checkpointing=async_save, create=create,
                                               cleanup_tmp_directories=create,
                                               async_options=ocp.AsyncOptions(barrier_sync_fn=_telling_barrier()))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices.

        ``state``: the train state dict (``params`` and the rest); ``data_state``: the data position of the whole
        batch (JSON-serialisable; written by the primary process). Every process must call it.
        """
        train = {k: v for k, v in state.items() if k != "params"}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            train=ocp.args.StandardSave(train),
            data=ocp.args.JsonSave(data_state),
        )
        self.manager.save(step, args=args)

    def restore(self, step: int, abstract_state: dict, *, params_only: bool = False) -> tuple[dict, dict | None]:
        """Restore ``step`` onto the shardings carried by ``abstract_state`` (ShapeDtypeStructs).

        Returns ``(state, data position)``; with ``params_only``, ``({"params": ...}, None)``.
        """
        items = {"params": ocp.args.StandardRestore(abstract_state["params"])}
        if params_only:
            return {"params": self._restore(step, items)["params"]}, None
        train = {k: v for k, v in abstract_state.items() if k != "params"}
        items.update(train=ocp.args.StandardRestore(train), data=ocp.args.JsonRestore())
        # the optimizer state kept by layer or stacked (optimizer.layered: --optim.offload with the layers'
        # parameters on the device, or not): a checkpoint of one layout resumes in the other
        restored = self._restore(step, items, lambda: {**items, "train": ocp.args.StandardRestore(
            {**train, "opt_state": optimizer.other_layout(train["opt_state"])})})
        if restored.get("relaid"):
            restored["train"]["opt_state"] = optimizer.relayout(restored["train"]["opt_state"], train["opt_state"])
        return {"params": restored["params"], **restored["train"]}, restored["data"]

    def restore_master(self, step: int, abstract_params):
        """The float32 master weights of ``step`` (``--optim.master-weights``: ``optimizer.MasterState.master``) alone,
        laid out as ``abstract_params`` (the optimizer's moments are not read)."""
        import jax.numpy as jnp

        master = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=a.sharding),
                              abstract_params)
        def args(master):
            item = {"opt_state": {"master": master}}
            restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype), item)
            return {"train": ocp.args.PyTreeRestore(item, restore_args, partial_restore=True)}

        restored = self._restore(step, args(master), lambda: args(optimizer.per_layer(master)))  # stacked, or by layer
        got = restored["train"]["opt_state"]["master"]
        return jax.tree.map(lambda _, x: x, master, optimizer.relayout(got, master) if restored.get("relaid") else got)

    def _restore(self, step: int, items: dict, relaid=None):
        """The checkpoint's ``items``; where their tree does not match it, ``relaid()``'s (the optimizer state in its
        other layout, ``optimizer.other_layout``), with ``"relaid": True`` in the result."""
        where = self.directory / str(step)
        try:
            try:
                return self.manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # noqa: BLE001 - classified below, after the other layout is tried
                if relaid is None or _io_error(e) is not None or not _tree_mismatch(e):
                    raise
                try:
                    return {**self.manager.restore(step, args=ocp.args.Composite(**relaid())), "relaid": True}
                except Exception as other:  # noqa: BLE001
                    if _tree_mismatch(other):  # not the other layout either: the first error tells why
                        raise e from None
                    raise  # the other layout's tree, but unreadable: that error (I/O, damage) tells why
        except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many kinds; we classify them
            io = _io_error(e)
            if io is not None:
                raise ValueError(
                    f"checkpoint {where} cannot be read: I/O error ({io}); the checkpoint itself may be fine: "
                    f"check the file system (permissions, mounts, free space) and run the same command again"
                ) from e
            reason = " ".join((str(e).strip().splitlines() or [type(e).__name__])[0].split())[:200]
            if "tree structures do not match" in reason:  # every checkpoint of the run has the same structure
                raise ValueError(
                    f"checkpoint {where} holds parameters laid out unlike this model's ({reason}): it was written by "
                    f"another model or another version of ulysses_jax (a LoRA + --fp8 run checkpointed before "
                    f"2026-11-27 evening holds its base in bf16; now it rests in float8); start a new --run-dir, or "
                    f"resume it with the version that wrote it"
                ) from e
            others = [s for s in self.steps() if s != step]
            fix = (f"resume from another one with --resume-from STEP (here: {', '.join(map(str, others))})" if others
                   else "start a new --run-dir")
            raise ValueError(
                f"checkpoint {where} is damaged or not from this run ({type(e).__name__}: {reason}); {fix}"
            ) from e

    def set_aside(self, after: int) -> pathlib.Path | None:
        """Move the checkpoints of steps after ``after`` to ``run_dir/checkpoints-set-aside/`` (process 0 moves)."""
        later = [s for s in self.steps() if s > after]
        if not later:
            return None
        dest = self.directory.parent / "checkpoints-set-aside"
        if jax.process_index() == 0:
            dest.mkdir(exist_ok=True)
            for s in later:
                target = dest / str(s)
                n = 1
                while target.exists():
                    target, n = dest / f"{s}.{n}", n + 1
                shutil.move(str(self.directory / str(s)), str(target))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoints set aside")
        self.manager.reload()
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _telling_barrier():
    """Orbax's barrier between the processes' background writes, telling the other processes first when this one's
    write failed. Orbax's background thread meets that error and goes on to its next barrier with it in hand
    (``sys.exc_info()``), while the other processes wait at another barrier, for Orbax's timeout (20 minutes), before
    anyone's main thread hears of it. Told (``watchdog.failing``: a multi-process job's failure mark), they stop at
    once."""
    barrier = ocp.multihost.get_barrier_sync_fn()

    def sync(*, key: str, timeout_ms: int) -> None:
        error = sys.exc_info()[1]
        if error is not None:
            from ulysses_jax.train import watchdog

            watchdog.failing(error)
        barrier(key=key, timeout_ms=timeout_ms)

    return sync


def gather(obj) -> list:
    """``obj`` (JSON-serialisable) from every process, in process order (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([raw.size]))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    every = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(every[i][: int(lengths[i][0])]).decode()) for i in range(jax.process_count())]
