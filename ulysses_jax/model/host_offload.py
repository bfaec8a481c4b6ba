"""Memory kinds: arrays moved between device memory and pinned host memory, inside a jitted program.

``to_device`` / ``to_host`` move a tree; ``stream_in`` moves one layer's parameters in and sends its gradient back
out (the layer scan under ``ModelConfig.offload_params``). Inside a step the moves are ``compute_on2`` identities
with an output memory space: XLA sees its host-offload annotations on every backend that lowers them, compile-only
GPUs included (whose devices list no memory kinds, so JAX drops the ``pinned_host`` kind from shardings: there XLA
places the arrays in host memory from the annotations alone). The CPU backend runs the same program with host and
device the same memory: it checks the values, not the placement. The optimizer that streams its state through these
moves is ``train/optimizer.py``.
"""

from __future__ import annotations

import jax

try:
    from jax.experimental.compute_on import compute_on2
except ImportError:  # jax 0.11.2 (the lent GPUs' image, 2026-11) has no compute_on2: moves by device_put alone
    compute_on2 = None

HOST = "pinned_host"
STACKED = "blocks"  # parameters under this name carry the stacked layers on their leading axis

if compute_on2 is not None:
    _to_device = compute_on2(lambda x: x, compute_type="device", out_memory_spaces=jax.memory.Space.Device)
    _to_host = compute_on2(lambda x: x, compute_type="device", out_memory_spaces=jax.memory.Space.Host)
else:  # right on devices with memory kinds (real GPUs); compile-only GPUs then get no host-offload annotation
    def _to_device(x):
        return jax.device_put(x, jax.memory.Space.Device)

    def _to_host(x):
        return jax.device_put(x, jax.memory.Space.Host)


def to_device(tree):
    """``tree``'s arrays moved to device memory (a no-op where they are there already)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_to_device(x) for x in leaves])


def to_host(tree):
    """``tree``'s arrays moved to pinned host memory."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_to_host(x) for x in leaves])


def _streamed(move_in, move_out):
    """An identity that moves its input with ``move_in`` and its cotangent with ``move_out``."""

    @jax.custom_vjp
    def move(x):
        return move_in(x)

    move.defvjp(lambda x: (move_in(x), None), lambda _, ct: (move_out(ct),))
    return move


# Arrays typed as host memory (devices with memory kinds: GPUs, CPUs) move by ``device_put`` to a memory space, which
# keeps JAX's types right; on compile-only GPUs (no memory kinds: every array is typed as device memory) the
# ``compute_on2`` annotations tell XLA instead, as for the optimizer state.
_stream_typed = _streamed(lambda x: jax.device_put(x, jax.memory.Space.Device),
                          lambda ct: jax.device_put(ct, jax.memory.Space.Host))
_stream_annotated = _streamed(_to_device, _to_host)


def stream_in(tree):
    """``tree`` (one layer's parameters, at rest in host memory) moved to the device; its cotangent (the layer's
    gradient) goes back to host memory. In the layer scan (``ModelConfig.offload_params``) the device then holds
    one layer's parameters in the forward and one layer's gradient in the backward; the stacked gradient is
    written to host memory layer by layer."""

    def move(x):
        on_host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        return _stream_typed(x) if on_host else _stream_annotated(x)

    return jax.tree.map(move, tree)
