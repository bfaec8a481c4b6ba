"""The loops of the tiled attention sublayer (``tiled_attention.py``) over a device's sequence chunks, inside
``shard_map`` (axis ``SP``): each chunk's projection and all-to-all written into whole-sequence buffers, and back.

A whole-sequence buffer is held as ``[b, sp, n, c, heads, H]``: chunk ``i`` of every device travels in one all-to-all,
device ``j``'s part holding global tokens ``j*s + i*c ...``, so the buffer takes it at index ``i`` of its third axis
and viewed as ``[b, S, heads, H]`` it is the natural token order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from ulysses_jax.model import fp8
from ulysses_jax.model.chunked import chunk, fresh, put, sum_f32, zeros_f32
from ulysses_jax.parallel.exchange import heads_to_seq, seq_to_heads
from ulysses_jax.parallel.mesh import SP

_F32 = jnp.float32


def row_major(buf):
    """``buf`` pinned row-major. A whole-sequence buffer filled from all-to-all results would otherwise take their
    layout (split dimension major: heads-major) and be transposed, whole, before the kernel, which reads row-major."""
    return with_layout_constraint(buf, Layout(major_to_minor=tuple(range(buf.ndim))))


def _exchanged(t, i):
    """Chunk ``i`` of a whole-sequence buffer ``t [b, sp, n, c, heads, H]`` as the all-to-all's ``[b, sp*c, ...]``."""
    part = jax.lax.dynamic_index_in_dim(t, i, axis=2, keepdims=False)
    return part.reshape(part.shape[0], -1, *part.shape[3:])


def _land(buf, part, i):
    """``buf [b, sp, n, c, heads, H]`` with the all-to-all's result ``part [b, sp*c, heads, H]`` as chunk ``i``."""
    b, sp, _, c = buf.shape[:4]
    return row_major(jax.lax.dynamic_update_slice_in_dim(buf, part.reshape(b, sp, 1, c, *part.shape[2:]), i, axis=2))


def _whole(buf):
    """``[b, sp, n, c, heads, H] -> [b, S, heads, H]`` (the natural token order)."""
    return buf.reshape(buf.shape[0], -1, *buf.shape[4:])


def _buffer(b, sp, n, c, like, anchor):
    return row_major(fresh((b, sp, n, c, like.shape[2] // sp, like.shape[3]), like.dtype, anchor))


def _tied(x, pos, w):
    """``x`` and ``pos`` (the whole sequence) tied to a group's weights ``w`` by an optimisation barrier (no copy).
    Each chunk's norm and RoPE tables, even its slice of ``x``, do not depend on the group; left free, XLA hoists
    the chunk loop's group-independent part out of the loop over head groups as a loop of its own that stacks every
    chunk's result: a whole ``[b, s, D]`` copy of the (normed) input and two float32 ``[s, H/2]`` tables, live
    through every group (the H100 buffer assignment, Llama-3.1-8B LoRA at 1.1M tokens: 8.4 GiB)."""
    x, pos, _ = jax.lax.optimization_barrier((x, pos, w))
    return x, pos


def fill_in(project, n: int, sp: int, x, pos, w, frozen=None):
    """``x [b, s, D]`` -> ``q [b, S, size, H], k, v [b, S, kv, H]``: ``project(x_chunk, pos_chunk, w, frozen)`` and
    the sequence -> heads all-to-alls chunk by chunk, written into whole-sequence buffers. ``frozen``: what
    ``project`` reads beside ``w`` that is never differentiated (the float8 weights)."""
    b, s, _ = x.shape
    c = s // n
    x, pos = _tied(x, pos, (w, frozen))
    shapes = jax.eval_shape(project, chunk(x, 0, c), chunk(pos, 0, c), w, frozen)
    bufs = tuple(_buffer(b, sp, n, c, t, x) for t in shapes)

    def body(i, bufs):
        parts = project(chunk(x, i, c), chunk(pos, i, c), w, frozen)
        return tuple(_land(buf, seq_to_heads(p, SP), i) for buf, p in zip(bufs, parts))

    return tuple(_whole(buf) for buf in jax.lax.fori_loop(0, n, body, bufs))


def grad_in(project, n: int, sp: int, x, pos, w, cts, dx, frozen=None):
    """The backward of ``fill_in``: per chunk, the gradients ``cts`` (``[b, S, heads, H]`` each) sent back and
    through ``project``'s backward; returns ``dx`` plus the input's gradient, and ``w``'s gradient in float32
    (``frozen``'s none)."""
    b, s, _ = x.shape
    c = s // n
    x, pos = _tied(x, pos, (w, frozen))
    cts = [ct.reshape(b, sp, n, c, *ct.shape[2:]) for ct in cts]

    def body(i, carry):
        dx, acc = carry
        ct = tuple(heads_to_seq(_exchanged(t, i), SP) for t in cts)  # [b, c, sp * heads, H] each
        _, vjp = jax.vjp(lambda xc, w: project(xc, chunk(pos, i, c), w, frozen), chunk(x, i, c), w)
        dxc, dw = vjp(ct)
        return put(dx, chunk(dx, i, c) + dxc, i, c), sum_f32(acc, dw)

    return jax.lax.fori_loop(0, n, body, (dx, zeros_f32(w)))


def fill_out(out_proj, n: int, sp: int, o, x, wo, post=None, gate=None):
    """``x + post(out_proj(heads -> sequence all-to-all of o))``, chunk by chunk: ``o [b, S, hq, H]`` (whole
    sequence, local heads), ``x [b, s, D]`` (local tokens, the residual) -> ``[b, s, D]``; ``post``: the
    post-attention norm of a chunk (Gemma 3), or ``None``; ``gate``: with an output gate, ``gate(i)`` is chunk
    ``i``'s ``sigmoid(gate)``, which ``out_proj(o, wo, gate)`` applies before the projection."""
    b, s, _ = x.shape
    c = s // n
    o6 = o.reshape(b, sp, n, c, *o.shape[2:])

    def body(i, y):
        y_c = out_proj(heads_to_seq(_exchanged(o6, i), SP), wo, None if gate is None else gate(i))
        return put(y, chunk(x, i, c) + (y_c if post is None else post(y_c)).astype(x.dtype), i, c)

    return jax.lax.fori_loop(0, n, body, fresh(x.shape, x.dtype, o))


def grad_post(out_proj, post, n: int, sp: int, o, ct, wo, scale):
    """The backward of the post-attention norm (Gemma 3), chunk by chunk: ``o [b, S, hq, H]`` (all heads), ``ct
    [b, s, D]`` -> (the gradient of the output projection's result ``[b, s, D]``, ``scale``'s gradient in float32);
    each chunk's projection recomputed from its exchange of ``o``."""
    b, s, _ = ct.shape
    c = s // n
    o6 = o.reshape(b, sp, n, c, *o.shape[2:])

    def body(i, carry):
        dy, acc = carry
        y_c = out_proj(heads_to_seq(_exchanged(o6, i), SP), wo)
        _, vjp = jax.vjp(post, y_c, scale)
        dy_c, dscale = vjp(chunk(ct, i, c).astype(y_c.dtype))
        return put(dy, dy_c, i, c), acc + dscale.astype(_F32)

    return jax.lax.fori_loop(0, n, body, (fresh(ct.shape, wo.dtype, ct), jnp.zeros(scale.shape, _F32)))


def grad_out(n: int, sp: int, o, ct, wo, fp8_on: bool = False, history=None, gate=None):
    """The backward of a group's output projection, chunk by chunk: ``o [b, S, size, H]`` (the group's output),
    ``ct [b, s, D]`` (the sublayer's gradient), ``wo [sp * size, H, D]`` (the group's output weights, slot order;
    with float8 their ``fp8.Quantized`` form) -> ``(do [b, S, size, H], dwo, history')``: per chunk ``ct @ wo^T``
    and its sequence -> heads all-to-all, and ``wo``'s gradient (float32) from the chunk's exchange of ``o``,
    recomputed. ``fp8_on``: both GEMMs in float8 (``fp8.grads``); ``history'``: with delayed scaling the history's
    new value (the chunks' amaxes meet in a max), else None.

    ``gate``: with an output gate (Qwen3.5), ``(fn, x, wg, dx)``: ``fn(x_chunk, wg)`` is a chunk's ``sigmoid(gate)``
    ``[b, c, sp * size, H]`` (slot order), which multiplied the exchanged output before the projection; ``x [b, s, D]``
    the sublayer's input, ``dx`` its gradient so far. Per chunk the gate's own gradient goes back through ``fn``
    at once (its norm and projection), so no buffer of it outlives the chunk; the call then returns ``(do, dwo,
    history', (dx', dwg))`` (``dwg``: ``wg``'s gradient in float32) instead of ``(do, dwo, history', None)``."""
    b, s, _ = ct.shape
    c = s // n
    o6 = o.reshape(b, sp, n, c, *o.shape[2:])
    like = jax.ShapeDtypeStruct((b, c, *wo.shape[:2]), wo.dtype)
    fn, x, wg, dx = gate if gate is not None else (None, None, None, None)

    def body(i, carry):
        buf, acc, h, gated = carry
        ct_i = chunk(ct, i, c).astype(wo.dtype)
        o_i = heads_to_seq(_exchanged(o6, i), SP)
        if fn is not None:
            g_i, vjp = jax.vjp(fn, chunk(x, i, c), wg)
            o_in = o_i * g_i
        else:
            o_in = o_i
        if fp8_on:
            do, dwo, new = fp8.grads("bsnh,nhd->bsd", o_in, wo, ct_i, history)
            h = h if new is None else jnp.maximum(h, new)
        else:
            do = jnp.einsum("bsd,nhd->bsnh", ct_i, wo)
            dwo = jnp.einsum("bsnh,bsd->nhd", o_in, ct_i, preferred_element_type=_F32)
        if fn is not None:  # d(o * g) = do: the output's gradient do * g, the gate's do * o
            dxc, dwg_i = vjp((do * o_i).astype(g_i.dtype))
            dx_acc, dwg = gated
            gated = (put(dx_acc, chunk(dx_acc, i, c) + dxc, i, c), sum_f32(dwg, dwg_i))
            do = do * g_i
        return _land(buf, seq_to_heads(do.astype(wo.dtype), SP), i), acc + dwo, h, gated

    h0 = None if history is None else jnp.zeros(history.shape, _F32)
    gated0 = None if fn is None else (dx, zeros_f32(wg))
    buf, dwo, h, gated = jax.lax.fori_loop(0, n, body, (_buffer(b, sp, n, c, like, ct), jnp.zeros(wo.shape, _F32),
                                                          h0, gated0))
    return _whole(buf), dwo, h, gated


def add_out(n: int, sp: int, o, acc, wo, fp8_on: bool = False, history=None, gate=None):
    """``acc [b, s, D]`` plus one group's output projection, chunk by chunk: ``o [b, S, size, H]`` (the group's
    output, whole sequence), ``wo [sp * size, H, D]`` (the group's output weights, slot order, dummy heads zero): per
    chunk the heads -> sequence all-to-all of ``o`` and ``o @ wo`` (in float8 with ``fp8_on``), added onto ``acc`` in
    place. ``gate``: with an output gate, ``gate(i)``: chunk ``i``'s ``sigmoid(gate)`` in the group's slot order,
    multiplying the exchanged output first."""
    b, s, _ = acc.shape
    c = s // n
    o6 = o.reshape(b, sp, n, c, *o.shape[2:])

    def body(i, acc):
        o_i = heads_to_seq(_exchanged(o6, i), SP)
        y = fp8.einsum("bsnh,nhd->bsd", o_i if gate is None else o_i * gate(i), wo, on=fp8_on, history=history,
                       preferred_element_type=_F32)
        return put(acc, chunk(acc, i, c).astype(_F32) + y, i, c)

    return jax.lax.fori_loop(0, n, body, acc)
