"""The program a training job compiles: its optimizer, the jitted step with the state's shardings and the abstract
batch, built by one function for ``train`` (on the real state) and for ``plan`` (on the abstract state of
compile-only GPUs), so that the two compile the same program from the same flags.
"""

from __future__ import annotations

import jax
import numpy as np

from ulysses_jax.train.step import (
    BATCH_KEYS,
    OptimConfig,
    batch_sharding,
    make_optimizer,
    make_schedule,
    make_train_step,
    state_shardings,
)


def optimizer_of(optim: OptimConfig, steps: int, replans=()):
    """The optimizer of a run of ``steps`` steps (``optim`` as resolved for it; ``replans``: the decay's re-plans)."""
    return make_optimizer(optim, steps, tuple(map(tuple, replans)))


def step_program(graphdef, state, tx, optim: OptimConfig, *, steps: int, replans=(), mesh, batch_size: int,
                 seq_len: int, grad_accum: int = 1):
    """``(step, batch)``: the jitted train step for ``state`` (real or abstract: only its shardings are read) and the
    abstract ``[batch_size, seq_len]`` batch it takes, ready for ``step.trace(state, batch).lower().compile()``."""
    schedule = make_schedule(optim, steps, tuple(map(tuple, replans)))
    step = make_train_step(graphdef, tx, schedule, mesh, state_shardings(state), grad_accum=grad_accum)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), np.int32, sharding=batch_sharding(mesh))
             for k in BATCH_KEYS}
    return step, batch
