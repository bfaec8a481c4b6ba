"""The Ulysses exchange: the two all-to-alls that turn a sequence-split activation into a head-split one and back.

``seq_to_heads`` turns ``[B, S/P, H, D]`` into ``[B, S, H/P, D]`` (every device: the whole sequence for a slice of
heads), ``heads_to_seq`` is its inverse; one ``jax.lax.all_to_all`` each, differentiable (each is the other's
transpose). ``exchange_bytes`` gives their per-device buffer sizes, which the tests check against the compiled HLO.
Attention around them is ``ulysses.py``; the ring that needs them across nodes is ``ring.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ulysses_jax.parallel.head_layout import HeadLayout


def seq_to_heads(x: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S/P, H, D] -> [B, S, H/P, D]``: one all-to-all; needs ``H % P == 0``."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S, H/P, D] -> [B, S/P, H, D]``: one all-to-all, the inverse of ``seq_to_heads``."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def local_sinks(sinks: jax.Array, layout: HeadLayout, axis_name: str) -> jax.Array:
    """``sinks [H]`` -> ``[hq]``: the attention sinks of this device's query heads after ``seq_to_heads`` (inside
    ``shard_map``); a dummy head gets head 0's, which changes nothing (its output is dropped, its gradient zero)."""
    table = np.maximum(np.asarray(layout.q_slots), 0).reshape(layout.sp, layout.heads_per_device)
    return jnp.take(sinks, jnp.asarray(table, jnp.int32)[jax.lax.axis_index(axis_name)])


def exchange_bytes(layout: HeadLayout, *, batch: int, seq_len: int, head_dim: int, itemsize: int,
                   ring: int = 1) -> dict[str, int]:
    """Per-device buffer bytes of the two all-to-alls (``batch`` = per-device batch, ``seq_len`` = global S,
    split over ``ring`` x sp)."""
    tokens = batch * (seq_len // (ring * layout.sp))
    qkv_heads = layout.padded_heads + 2 * layout.kv_heads_sent
    return {
        "qkv": tokens * qkv_heads * head_dim * itemsize,
        "out": tokens * layout.padded_heads * head_dim * itemsize,
        "sent_fraction_num": layout.sp - 1,
        "sent_fraction_den": layout.sp,
    }
