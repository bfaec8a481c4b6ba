"""A run that diverged: the error, its one sentence, and the check that keeps a non-finite state out of a checkpoint.

The trainer stops at the first step whose loss or gradient norm is not finite (the update then took a non-finite
gradient), and before writing a checkpoint whose parameters are not finite (a finite gradient times a huge rate can
overflow them). Nothing of that step is saved; the sentence names the last good checkpoint and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class TrainingDiverged(RuntimeError):
    pass


def diverged(what: str, last_saved: int | None, directory) -> TrainingDiverged:
    """The error for ``what`` went wrong (``"loss is nan at step 3"``), naming the last good checkpoint."""
    where = (f"step {last_saved} in {directory}: continue from it with --resume, or from an earlier one with "
             f"--resume-from STEP" if last_saved is not None else "none yet")
    return TrainingDiverged(f"{what}; stopped without saving (last good checkpoint: {where}); if it recurs, start a "
                            f"new --run-dir with a lower --optim.lr or more --optim.warmup-steps")


@jax.jit
def all_finite(params) -> jax.Array:
    """Whether every floating-point parameter is finite."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)
