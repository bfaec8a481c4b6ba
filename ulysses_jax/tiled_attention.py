"""The attention sublayer in sequence tiles around the Ulysses exchange (``ModelConfig.attn_chunk``).

``x + attention(norm(x))`` for one layer, computed so that no tensor the size of a device's whole
``[S/sp, heads]`` slice exists twice. The plain path (``model.Attention`` + ``ulysses_attention``) holds, per
device and all at once, the normed input, the fused Q/K/V projection before the all-to-all and its head-sliced
form after it, and the attention output before and after its all-to-all; at the longest contexts those copies
are what fills an H100 (``experiments/results/memory_to_the_limit_h100.md``).

Here each device cuts its ``s = S/sp`` tokens into ``n`` chunks of ``c = attn_chunk`` tokens. Per chunk:
RMSNorm, the Q/K/V projections (bias, per-head norm, RoPE), the head layout of ``head_layout.py``, and the
all-to-alls, whose results go straight into their place in three whole-sequence buffers ``q [b, S, hq, H]``,
``k, v [b, S, k_loc, H]``. Q, K and V cross in three all-to-alls per chunk (each result lands whole in its
buffer; a fused one would be sliced per chunk), and the buffers are pinned row-major: left free, XLA gave them the
all-to-all's heads-major layout and copied Q, whole, into the kernel's layout (seen in the compiled H100 program).
The local kernel (any ``impl``) runs once on them. Then per chunk: that chunk of the output goes back by its
all-to-all, through the output projection, and is added to the residual. Only one chunk's pre-exchange tensors
exist at a time.

Where a chunk lands. Chunk ``i`` of every device travels in the same all-to-all: device ``j``'s part holds the
global tokens ``j*s + i*c ...``. Viewed as ``[b, sp, n, c, heads, H]``, the buffer takes the all-to-all's
``[b, sp, c, heads, H]`` at index ``i`` of its third axis, and the view is the natural token order, so the
kernel sees the sequence as the plain path does (causal masks and segment ids unchanged).

The backward (``jax.custom_vjp``) walks the chunks again: for the input side it slices the whole-sequence
gradient of Q/K/V per chunk, sends it back, and differentiates the recomputed chunk projection (its weight
gradients summed in float32); for the output side it recomputes the chunk's all-to-all of the output (one
extra all-to-all of ``O`` per layer: the price of not keeping the exchanged output) and writes the output's
gradient into its whole-sequence buffer. Plain autodiff of the same loops would keep every chunk's
projections as residuals, which is the memory this module exists to avoid.

Needs a mesh without a ring (``ring = 1``): with a ring, each device's tokens of the exchange are the ring's
zigzag share, which these buffers do not model. Runs in ``shard_map``; parameters arrive in their at-rest
(FSDP) layout and are gathered here, their gradients reduce-scattered by the gather's transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.attention import attention, device_platform, resolve_impl
from ulysses_jax.chunked import cast_like, chunk, fresh, put, sum_f32, zeros_f32
from ulysses_jax.config import ModelConfig, local_chunks
from ulysses_jax.head_layout import HeadLayout, plan_heads
from ulysses_jax.mesh import DATA, FSDP, RING, SEQ, SP
from ulysses_jax.sharding import fsdp_axes, gather_param, param_spec
from ulysses_jax.ulysses import heads_to_seq, seq_to_heads

# The attention parameters of one layer, by name: (logical axes, the axis to gather for FSDP or None).
PARAMS = {
    "norm": (("embed",), 0),
    "wq": (("embed", "heads", "head_dim"), 0),
    "wk": (("embed", "kv_heads", "head_dim"), 0),
    "wv": (("embed", "kv_heads", "head_dim"), 0),
    "wo": (("heads", "head_dim", "embed"), 2),
    "bq": (("heads", "head_dim"), None),
    "bk": (("kv_heads", "head_dim"), None),
    "bv": (("kv_heads", "head_dim"), None),
    "q_norm": (("head_dim",), None),
    "k_norm": (("head_dim",), None),
}


# ----------------------------------------------------------------------------------------------
# One chunk: what goes into the exchange, what comes out of it


def project_chunk(x_bcD, pos_bc, w: dict, *, cfg: ModelConfig, layout: HeadLayout):
    """``x [b, c, D] -> (q [b, c, sp * hq, H], k, v [b, c, sp * k_loc, H])``: normed, projected, rotated, in the head
    layout's slots (the operands of the all-to-alls)."""
    from ulysses_jax.model import apply_rope, rms_norm, rope_frequencies  # model imports this module

    xn = rms_norm(x_bcD, w["norm"], cfg.rms_eps)
    q = jnp.einsum("bsd,dnh->bsnh", xn, w["wq"])
    k = jnp.einsum("bsd,dkh->bskh", xn, w["wk"])
    v = jnp.einsum("bsd,dkh->bskh", xn, w["wv"])
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg.rms_eps), rms_norm(k, w["k_norm"], cfg.rms_eps)
    inv_freq = rope_frequencies(cfg)
    q, k = apply_rope(q, pos_bc, inv_freq), apply_rope(k, pos_bc, inv_freq)
    return layout.gather_q(q), layout.gather_kv(k), layout.gather_kv(v)


def output_chunk(o_bcXH, w: dict, *, layout: HeadLayout):
    """``[b, c, sp * hq, H]`` (a chunk of the output after its all-to-all) ``-> [b, c, D]``: the output projection."""
    return jnp.einsum("bsnh,nhd->bsd", layout.ungather_out(o_bcXH), w["wo"])


# ----------------------------------------------------------------------------------------------
# The two tiled exchanges, each with its own backward


def _row_major(buf):
    """``buf`` pinned row-major. A whole-sequence buffer filled from all-to-all results would otherwise take their
    layout (split dimension major: heads-major) and be transposed, whole, before the kernel, which reads row-major."""
    return with_layout_constraint(buf, Layout(major_to_minor=tuple(range(buf.ndim))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def exchange_in(project, layout: HeadLayout, n: int, axis_name: str, x, pos, w):
    """``x [b, s, D]`` (local) -> ``q [b, S, hq, H], k, v [b, S, k_loc, H]``: ``project`` and the sequence -> heads
    all-to-alls chunk by chunk, written into whole-sequence buffers."""
    b, s, _ = x.shape
    c, sp = s // n, layout.sp
    shapes = jax.eval_shape(project, chunk(x, 0, c), chunk(pos, 0, c), w)
    bufs = tuple(_row_major(fresh((b, sp, n, c, t.shape[2] // sp, t.shape[3]), t.dtype, x)) for t in shapes)

    def body(i, bufs):
        parts = (seq_to_heads(t, axis_name) for t in project(chunk(x, i, c), chunk(pos, i, c), w))
        return tuple(_row_major(jax.lax.dynamic_update_slice_in_dim(buf, p.reshape(b, sp, 1, c, *p.shape[2:]), i,
                                                                    axis=2))
                     for buf, p in zip(bufs, parts))

    bufs = jax.lax.fori_loop(0, n, body, bufs)
    return tuple(buf.reshape(b, sp * n * c, *buf.shape[4:]) for buf in bufs)


def _exchange_in_fwd(project, layout, n, axis_name, x, pos, w):
    return exchange_in(project, layout, n, axis_name, x, pos, w), (x, pos, w)


def _exchange_in_bwd(project, layout, n, axis_name, res, cts):
    x, pos, w = res
    b, s, _ = x.shape
    c, sp = s // n, layout.sp
    cts = [ct.reshape(b, sp, n, c, *ct.shape[2:]) for ct in cts]

    def body(i, carry):
        dx, acc = carry
        ct = tuple(heads_to_seq(jax.lax.dynamic_index_in_dim(t, i, axis=2, keepdims=False).reshape(b, sp * c,
                                                                                                   *t.shape[4:]),
                                axis_name) for t in cts)  # q [b, c, sp*hq, H], k, v [b, c, sp*k_loc, H]
        _, vjp = jax.vjp(lambda xc, w: project(xc, chunk(pos, i, c), w), chunk(x, i, c), w)
        dxc, dw = vjp(ct)
        return put(dx, dxc, i, c), sum_f32(acc, dw)

    dx, dw = jax.lax.fori_loop(0, n, body, (fresh(x.shape, x.dtype, cts[0]), zeros_f32(w)))
    return dx, None, cast_like(dw, w)


exchange_in.defvjp(_exchange_in_fwd, _exchange_in_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def exchange_out(out_proj, layout: HeadLayout, n: int, axis_name: str, o, x, w):
    """``x + out_proj(heads -> sequence all-to-all of o)``, chunk by chunk: ``o [b, S, hq, H]`` (whole sequence,
    local heads), ``x [b, s, D]`` (local tokens, the residual) -> ``[b, s, D]``."""
    b, s, _ = x.shape
    c, sp = s // n, layout.sp
    o6 = o.reshape(b, sp, n, c, *o.shape[2:])

    def body(i, y):
        oi = jax.lax.dynamic_index_in_dim(o6, i, axis=2, keepdims=False).reshape(b, sp * c, *o.shape[2:])
        return put(y, chunk(x, i, c) + out_proj(heads_to_seq(oi, axis_name), w).astype(x.dtype), i, c)

    return jax.lax.fori_loop(0, n, body, fresh(x.shape, x.dtype, o))


def _exchange_out_fwd(out_proj, layout, n, axis_name, o, x, w):
    return exchange_out(out_proj, layout, n, axis_name, o, x, w), (o, w)


def _exchange_out_bwd(out_proj, layout, n, axis_name, res, ct):
    o, w = res
    b, s, _ = ct.shape
    c, sp = s // n, layout.sp
    tail = o.shape[2:]
    o6 = o.reshape(b, sp, n, c, *tail)

    def body(i, carry):
        do, acc = carry
        oi = heads_to_seq(jax.lax.dynamic_index_in_dim(o6, i, axis=2, keepdims=False).reshape(b, sp * c, *tail),
                          axis_name)  # the forward's exchanged chunk, recomputed
        _, vjp = jax.vjp(out_proj, oi, w)
        doi, dw = vjp(chunk(ct, i, c).astype(oi.dtype))
        doi = seq_to_heads(doi, axis_name).reshape(b, sp, 1, c, *tail)
        return _row_major(jax.lax.dynamic_update_slice_in_dim(do, doi, i, axis=2)), sum_f32(acc, dw)

    do, dw = jax.lax.fori_loop(0, n, body, (_row_major(fresh(o6.shape, o.dtype, ct)), zeros_f32(w)))
    return do.reshape(o.shape), ct, cast_like(dw, w)


exchange_out.defvjp(_exchange_out_fwd, _exchange_out_bwd)


# ----------------------------------------------------------------------------------------------
# The sublayer


def check_tiled_attention(chunk: int, mesh: Mesh, local_seq: int, flag: str = "attn_chunk") -> int:
    """The number of chunks; raises ``ValueError`` for a mesh with a ring or a chunk that does not divide."""
    if mesh.shape[RING] > 1:
        raise ValueError(f"{flag} ({chunk}) tiles the Ulysses exchange of a mesh without a ring, but this mesh has "
                         f"ring = {mesh.shape[RING]}; set {flag} to 0 with a ring")
    return local_chunks(chunk, local_seq, flag)


def tiled_attention(x_BSD, positions_BS, segment_ids_BS, params: dict, *, cfg: ModelConfig, mesh: Mesh,
                    chunk: int) -> jax.Array:
    """``x + attention(rms_norm(x))`` of one layer (global arrays, ``x [B, S, D]`` sequence-sharded), tiled as in
    the module doc. ``params``: the layer's attention parameters by the names of ``PARAMS`` (``"norm"`` is the
    pre-attention RMSNorm's scale; absent optional ones are left out), in the compute dtype (the norm scales in
    float32) and at-rest layout."""
    sp = mesh.shape[SP]
    check_tiled_attention(chunk, mesh, x_BSD.shape[1] // sp)
    platform = device_platform(mesh)
    dt = cfg.compute_jnp_dtype
    impl = resolve_impl(cfg.attention_impl, dtype=dt, head_dim=cfg.head_dim,
                        has_segment_ids=segment_ids_BS is not None, platform=platform)
    layout = plan_heads(cfg.num_heads, cfg.num_kv_heads, sp)
    over_data = cfg.shard_params_over_data
    names = sorted(params)
    w_specs = [param_spec(PARAMS[k][0], over_data=over_data) for k in names]
    act, tok = P((DATA, FSDP), SEQ, None), P((DATA, FSDP), SEQ)
    project = functools.partial(project_chunk, cfg=cfg, layout=layout)
    out_proj = functools.partial(output_chunk, layout=layout)
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def local(x, pos, seg, *ws):
        w = {}
        for k, v in zip(names, ws):
            axis = PARAMS[k][1]
            w[k] = v if axis is None else jax.lax.all_gather(v, fsdp_axes(over_data), axis=axis, tiled=True)
        n = x.shape[1] // chunk
        w_in = {k: v for k, v in w.items() if k != "wo"}
        q, k, v = exchange_in(project, layout, n, SP, x, pos, w_in)
        if seg is not None:
            seg = jax.lax.all_gather(seg, SP, axis=1, tiled=True)  # [b, S]
        o = attention(q, k, v, causal=True, segment_ids=seg, scale=scale, impl=impl, platform=platform)
        return exchange_out(out_proj, layout, n, SP, o, x, {"wo": w["wo"]})

    has_seg = segment_ids_BS is not None
    args = [x_BSD, positions_BS, *([segment_ids_BS] if has_seg else []), *(params[k] for k in names)]
    specs = [act, tok, *([tok] if has_seg else []), *w_specs]

    def body(x, pos, *rest):
        return local(x, pos, rest[0], *rest[1:]) if has_seg else local(x, pos, None, *rest)

    # the custom rules and the kernels carry no varying-manual-axes types
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=act, check_vma=False)
    return fn(*args)
