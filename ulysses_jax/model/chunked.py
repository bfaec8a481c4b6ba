"""Loops over chunks of a device's local sequence, with buffers XLA keeps in the loop and a backward of their own.

Used inside ``shard_map`` by the tiled sublayers (``mlp.tiled_swiglu``, ``moe.py``, ``tiled_attention.py``):
activations are ``[b, s, ...]`` per device and a chunk is ``c`` consecutive of its ``s`` tokens.

Two facts of the compiled H100 program shape this module (read from its buffer assignment, Llama-3.1-8B at 8M tokens
on 8 GPUs):

* A loop's output buffer must not be a constant. ``lax.scan`` stacks its outputs into a zeros buffer, and a
  ``custom_vjp`` or autodiff loop inside the layer ``scan`` creates such buffers per layer; XLA hoists the constant
  out of the layer loop, where it then lives for the whole loop and is copied on every iteration. ``fresh`` derives
  the buffer from a value of the layer instead, and the loops here write into it with ``dynamic_update_slice``.
* Autodiff of a chunk loop saves every chunk's intermediates, or (under ``jax.checkpoint``) builds its input
  gradient in such a stacked buffer. ``chunk_map``'s own backward recomputes each chunk and writes its gradient in
  place, into the incoming gradient's buffer (each chunk of it is read once, just before it is overwritten),
  summing the weights' gradients in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ulysses_jax.model.fp8 import HISTORY_KEY


def chunk(x: jax.Array, i, c: int) -> jax.Array:
    """Tokens ``[i*c, (i+1)*c)`` of ``x [b, s, ...]``."""
    return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)


def put(buf: jax.Array, y: jax.Array, i, c: int) -> jax.Array:
    """``buf`` with tokens ``[i*c, (i+1)*c)`` replaced by ``y``."""
    return jax.lax.dynamic_update_slice_in_dim(buf, y.astype(buf.dtype), i * c, axis=1)


def fresh(shape, dtype, anchor: jax.Array) -> jax.Array:
    """A buffer for a loop to fill before anything reads it (its values never matter), derived from ``anchor`` (a
    value of the current layer) so that XLA cannot hoist it out of the layer loop (module doc)."""
    return jnp.broadcast_to((anchor.reshape(-1)[0] * 0).astype(dtype), shape)


def sum_f32(acc, g):
    """``acc + g`` in float32, leaf by leaf; a float8 amax history (a dict's ``fp8.HISTORY_KEY`` entry, whose
    "gradient" is its new value) takes the max instead."""
    def add(path, a, b):
        if any(isinstance(k, jax.tree_util.DictKey) and k.key == HISTORY_KEY for k in path):
            return jnp.maximum(a, b.astype(jnp.float32))
        return a + b.astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(add, acc, g)


def zeros_f32(w):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), w)


def cast_like(g, w):
    return jax.tree.map(lambda a, b: a.astype(b.dtype), g, w)


def chunk_map(fn, n: int, x: jax.Array, w, frozen=None, extra=None) -> jax.Array:
    """``fn`` applied to each of the ``n`` chunks of ``x [b, s, D]`` with weights ``w``: ``[b, s, D']``.

    ``fn(x_chunk, w)`` must act per token (no mixing across tokens). Forward: one chunk's intermediates at a time.
    Backward: each chunk's forward recomputed, its input gradient written in place, ``w``'s summed in float32.

    ``frozen`` (arrays that get no gradient: LoRA's base weights, a random key) or ``extra`` (an array ``[b, s, ...]``
    cut into chunks like ``x``, no gradient either: token ids): ``fn(x_chunk, w, frozen, extra_chunk)`` instead.
    """
    if frozen is None and extra is None:
        return _chunk_map(lambda xc, w, frozen, e: fn(xc, w), n, x, w, None, None)
    return _chunk_map(fn, n, x, w, frozen, extra)


def _chunk(e, i, c):
    return None if e is None else chunk(e, i, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_map(fn, n: int, x: jax.Array, w, frozen, extra) -> jax.Array:
    c = x.shape[1] // n
    out = jax.eval_shape(fn, chunk(x, 0, c), w, frozen, _chunk(extra, 0, c))
    # in place where shapes allow: chunk i of x is read only by step i, just before step i overwrites it, so the output
    # takes x's buffer where x is not read afterwards (a layer's forward whose input is not kept: one [b, s, D] buffer
    # less); where x is kept, XLA copies it first, as much memory as a fresh buffer
    in_place = out.shape[2:] == x.shape[2:] and out.dtype == x.dtype
    y = x if in_place else fresh((*x.shape[:2], *out.shape[2:]), out.dtype, x)
    return jax.lax.fori_loop(
        0, n, lambda i, y: put(y, fn(chunk(y if in_place else x, i, c), w, frozen, _chunk(extra, i, c)), i, c), y)


def _chunk_map_fwd(fn, n, x, w, frozen, extra):
    return _chunk_map(fn, n, x, w, frozen, extra), (x, w, frozen, extra)


def _chunk_map_bwd(fn, n, res, ct):
    x, w, frozen, extra = res
    c = x.shape[1] // n
    # the input's gradient goes into ct's own buffer when shapes allow: chunk i of ct is read only by step i, before
    # step i overwrites it, so XLA updates it in place and one [b, s, D] buffer less is live during the backward
    in_place = ct.shape == x.shape and ct.dtype == x.dtype

    def body(i, carry):
        dx, acc = carry
        _, vjp = jax.vjp(lambda xc, w: fn(xc, w, frozen, _chunk(extra, i, c)), chunk(x, i, c), w)
        dxc, dw = vjp(chunk(dx if in_place else ct, i, c))
        return put(dx, dxc, i, c), sum_f32(acc, dw)

    dx, dw = jax.lax.fori_loop(0, n, body, (ct if in_place else fresh(x.shape, x.dtype, ct), zeros_f32(w)))
    return dx, cast_like(dw, w), None, None  # None: no gradient for frozen and extra


_chunk_map.defvjp(_chunk_map_fwd, _chunk_map_bwd)
