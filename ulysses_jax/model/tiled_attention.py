"""The attention sublayer in sequence tiles around the Ulysses exchange, its heads in groups
(``ModelConfig.attn_chunk``, ``attn_head_chunk``, ``attn_recompute``).

``x + attention(rms_norm(x))`` for one layer, computed so that no tensor the size of a device's whole
``[S/sp, heads]`` slice exists twice and the kernel's whole-sequence operands exist for one group of heads at a
time. The plain path (``model.Attention`` + ``ulysses_attention``) holds at once the normed input, the Q/K/V
projection before the all-to-all and after it, and the output before and after its all-to-all; at the longest
contexts those copies are what fills an H100 (``experiments/results/memory_to_the_limit_h100.md``).

Sequence tiles. Each device cuts its ``s = S/sp`` tokens into ``n`` chunks of ``c = attn_chunk``. Per chunk: RMSNorm,
the Q/K/V projections (bias, per-head norm, RoPE) and three all-to-alls, whose results land in whole-sequence
buffers ``q [b, S, heads, H]``, ``k, v [b, S, kv, H]`` pinned row-major (left free, XLA gave them the all-to-all's
heads-major layout and copied Q, whole, for the kernel). Chunk ``i`` of every device travels in one all-to-all:
device ``j``'s part holds global tokens ``j*s + i*c ...``, so viewed as ``[b, sp, n, c, heads, H]`` the buffer takes
it at index ``i`` of its third axis, and the view is the natural token order (masks and segment ids unchanged).
After the kernel, per chunk, the output goes back by its all-to-all, through the output projection, onto the
residual.

Head groups. A device computes ``hq`` query heads (``head_layout.py``: real, padded, or sharing a copied KV head).
``attn_head_chunk = h`` cuts them into ``hq / h`` groups, each projected, exchanged and run through the kernel on its
own, so Q, K, V, dO, dQ, dK, dV exist for one group: ``hq / h`` times smaller. ``h`` is a multiple or a divisor of
the query heads per KV head on a device, so that a group is plain GQA (whole KV heads, or a share of one KV head's
queries: that KV head is then projected and exchanged once per group that reads it: more K/V bytes on the wire,
the same attention). ``HeadGroups`` cuts the weights to each group's exchange slots, dummy heads zero.

Forward: per group, the chunked projection and exchange and the kernel's forward with its log-sum-exp
(``ring.LocalKernel``), the output written into the device's ``O [b, S, hq, H]``; then the output's chunked exchange
and projection over all heads, as without groups. Residuals: input, weights, ``O`` and log-sum-exps (with
``attn_recompute``, neither ``O`` nor those: each group's kernel forward runs again in the backward, one more
attention forward per layer). Backward, per group: the group's Q/K/V again chunk by chunk; ``dO`` (``ct @ wo^T`` and
its all-to-all) and the output weights' gradient (from each chunk's exchange of ``O``, recomputed) chunk by chunk;
the kernel's backward; per chunk its gradients sent back through the projection's backward onto the input's
gradient, the weights' gradients summed in float32. Plain autodiff of the same loops would keep every chunk's
projections as residuals, the memory this module exists to avoid. With several groups the input's gradient sums
one term per group in the compute dtype (as a tensor-parallel all-reduce of activation gradients does); the
forward sums as without groups.

Gemma 3 (``post_norms``): the post-attention norm is applied to each chunk of the output projection before the
residual add; its backward first runs the chunks' projections again from ``O`` (all heads) to send the gradient
through the norm, then the groups as above. It needs ``O``, so ``attn_recompute`` is refused with ``post_norms``.

The output gate (Qwen3.5 / Qwen3-Next, ``attn_output_gate``): the gathered ``wq``'s per-head ``[q | gate]`` is cut
into ``wq`` and ``wg`` (plain autodiff joins their gradients). The gate is a function of a chunk's own tokens, so it
never crosses the exchange: per chunk, after the output's all-to-all, ``sigmoid(norm(x) @ wg)`` multiplies it before
the output projection (a group's slots with the group's cut of ``wg``). Backward: the gate is recomputed per chunk
beside the output projection's backward, which sends ``dO * gate`` to the kernel and ``dO * O`` back through the
gate's sigmoid, projection and norm onto the input's gradient there and then: one more GEMM per chunk, no buffer.
Gemma 3's post-norm and the gate are not combined (``ModelConfig`` refuses it; no family has both).

Kernels: ``xla``, ``blockwise``, ``pallas`` through ``ring.ring_kernel`` (with the log-sum-exp); ``cudnn`` has none, so
its backward re-runs its forward (``jax.vjp``). Attention sinks (gpt-oss, ``params["sinks"] [heads]``, not cuDNN):
cut per group like the query heads; each device's kernel takes its heads', its backward their gradient. Needs a mesh
without a ring (a ring device's tokens are the ring's zigzag share, which these buffers do not model). Runs in
``shard_map``; parameters arrive at rest (FSDP) and are gathered here, their gradients reduce-scattered by the gather's
transpose.

Float8 (``cfg.fp8``, ``fp8.py``): q, k, v and o's weights are quantised where they rest (one scale per weight, an amax
over the devices) and gathered in float8 once per layer (``fp8.prequantize``; unsplit weights arrive quantised before
the layer loop, ``fp8_stack``): ``_sublayer`` takes them as ``fp8.Quantized`` beside zeros of their gathered shape in
``w`` (``fp8.grad_carrier``), and every chunk and head group reads them as they are (a group's cut of a float8 weight
keeps its scale). The chunks' projections run through ``fp8.einsum`` of ``fp8.Carried`` weights (their backward through
``grad_in``'s ``jax.vjp``: the weight gradient lands on the carrier, and the carrier's backward reduce-scatters it), the
output projection's backward through ``fp8.grads`` (``grad_out``). Activations and output gradients are scaled per chunk
and head group. The output gate's weight is cut from q's gathered float8 weight (one scale, as the plain path's one GEMM
has). The delayed recipe's history rides in ``params`` (``fp8.HISTORY_KEY``, a copy per device), its new values meeting
in a max over chunks, groups and devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.attention import attention, device_platform, resolve_impl
from ulysses_jax.kernels.sinks import sink_grad
from ulysses_jax.model import fp8
from ulysses_jax.model.chunked import cast_like, chunk, fresh, put, sum_f32, zeros_f32
from ulysses_jax.model.config import ModelConfig, local_chunks
from ulysses_jax.model.layers import apply_rope, norm_scale, rms_norm, rope_factor, rope_frequencies
from ulysses_jax.model.tiled_exchange import add_out, fill_in, fill_out, grad_in, grad_out, grad_post, row_major
from ulysses_jax.parallel.head_layout import HeadGroups, HeadLayout, head_groups, plan_heads
from ulysses_jax.parallel.mesh import DATA, FSDP, RING, SEQ, SP
from ulysses_jax.parallel.ring import ring_kernel
from ulysses_jax.parallel.sharding import fsdp_axes, param_spec

# The attention parameters of one layer, by name: (logical axes, the axis to gather for FSDP or None).
PARAMS = {
    "norm": (("embed",), 0),
    "wq": (("embed", "heads", "head_dim"), 0),
    "wg": (("embed", "heads", "head_dim"), None),  # the output gate's projection: cut from wq after its gather
    "wk": (("embed", "kv_heads", "head_dim"), 0),
    "wv": (("embed", "kv_heads", "head_dim"), 0),
    "wo": (("heads", "head_dim", "embed"), 2),
    "bq": (("heads", "head_dim"), None),
    "bk": (("kv_heads", "head_dim"), None),
    "bv": (("kv_heads", "head_dim"), None),
    "q_norm": (("head_dim",), None),
    "k_norm": (("head_dim",), None),
    "post_norm": (("embed",), 0),  # Gemma 3 (post_norms): the post-attention norm's scale
    "sinks": (("heads",), None),  # gpt-oss: one attention-sink logit per query head
    fp8.HISTORY_KEY: ((None, None, None), None),  # delayed float8: q, k, v, o's amax histories, a copy per device
}
FLOAT8 = ("wq", "wk", "wv", "wo")  # with --fp8: gathered in float8 (the rows of a delayed recipe's history)
_F32 = jnp.float32


# ----------------------------------------------------------------------------------------------
# Head groups (head_layout.HeadGroups): the weights cut to each group's exchange


def group_weights(w: dict, groups: HeadGroups, t) -> dict:
    """The weights of group ``t`` (traced or int): each head axis (``PARAMS``'s ``heads`` / ``kv_heads``) in the
    group's exchange slot order, dummy heads zero; other entries unchanged. Linear in ``w``. A float8 weight
    (``fp8.Quantized``) is cut the same way, its scale the whole weight's."""
    tables = {"heads": groups.q_heads(), "kv_heads": groups.kv_heads()}
    out = dict(w)
    for name, value in w.items():
        axes = PARAMS[name][0]
        head_axis = next((a for a in ("heads", "kv_heads") if a in axes), None)
        if head_axis is None:
            continue
        table, axis = tables[head_axis], axes.index(head_axis)
        if table.shape[0] == 1 and np.array_equal(table[0], np.arange(value.shape[axis])):
            continue  # one group, heads in their own order: nothing to cut
        idx = jnp.asarray(table)[t]
        if isinstance(value, fp8.Quantized) and value.qt is not None:  # its product would read qt, uncut
            raise ValueError(f"group_weights cuts {name}'s float8 weight but not its output-first copy (qt); pass it "
                             f"without one (fp8.prequantize makes none)")
        a = value.q if isinstance(value, fp8.Quantized) else value
        cut = jnp.take(a, jnp.maximum(idx, 0), axis=axis)
        if table.min() < 0:  # dummy heads zero (a select: float8 has no multiply)
            shape = [1] * cut.ndim
            shape[axis] = -1
            cut = jnp.where((idx >= 0).reshape(shape), cut, jnp.zeros((), cut.dtype))
        out[name] = dataclasses.replace(value, q=cut) if a is not value else cut
    return out


def _over_groups(count: int, body, carry):
    """``body(t, carry)`` for ``t = 0 .. count-1``: a loop, or one direct call for one group."""
    return body(0, carry) if count == 1 else jax.lax.fori_loop(0, count, body, carry)


# ----------------------------------------------------------------------------------------------
# One chunk: what goes into the exchange, what comes out of it


def project_chunk(x_bcD, pos_bc, w: dict, *, cfg: ModelConfig, local: bool = False):
    """``x [b, c, D] -> (q [b, c, sp * size, H], k, v [b, c, sp * kv, H])``: normed, projected by a group's weights
    (``group_weights``: already in the exchange's slot order; with float8 ``fp8.Carried`` ones), biased, normed per
    head, rotated (``local``: with a local layer's RoPE base)."""
    xn = rms_norm(x_bcD, norm_scale(w["norm"], cfg), cfg.rms_eps)
    hist = w.get(fp8.HISTORY_KEY)  # with cfg.fp8: float8 products (each chunk's own scale; a history if delayed)
    q = fp8.einsum("bsd,dnh->bsnh", xn, w["wq"], on=cfg.fp8, history=fp8.row(hist, 0))
    k = fp8.einsum("bsd,dkh->bskh", xn, w["wk"], on=cfg.fp8, history=fp8.row(hist, 1))
    v = fp8.einsum("bsd,dkh->bskh", xn, w["wv"], on=cfg.fp8, history=fp8.row(hist, 2))
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, norm_scale(w["q_norm"], cfg), cfg.rms_eps)
        k = rms_norm(k, norm_scale(w["k_norm"], cfg), cfg.rms_eps)
    inv_freq, f = rope_frequencies(cfg, local=local), rope_factor(cfg, local=local)
    return apply_rope(q, pos_bc, inv_freq, f), apply_rope(k, pos_bc, inv_freq, f), v


def gate_chunk(x_bcD, w: dict, *, cfg: ModelConfig):
    """The output gate of a chunk (Qwen3.5 / Qwen3-Next): ``sigmoid(rms_norm(x) @ wg)`` ``[b, c, heads, H]`` in the
    compute dtype, as ``model.Attention`` computes it (the sigmoid in float32). ``w``: ``"norm"`` and ``"wg"`` (all
    heads in their own order, or a group's slots; with float8 an ``fp8.Carried`` cut of q's float8 weight, whose scale
    it keeps). The chunk's input and output gradient take their own current amax (a delayed recipe's history rows are
    q, k, v and o's)."""
    xn = rms_norm(x_bcD, norm_scale(w["norm"], cfg), cfg.rms_eps)
    g = fp8.einsum("bsd,dnh->bsnh", xn, w["wg"], on=cfg.fp8)
    return jax.nn.sigmoid(g.astype(_F32)).astype(g.dtype)


def output_chunk(o_bcXH, wo, gate=None, *, layout: HeadLayout, fp8_on: bool = False, history=None):
    """``[b, c, sp * hq, H]`` (a chunk of the output after its all-to-all) ``-> [b, c, D]``: times the output gate
    ``gate [b, c, heads, H]`` (real head order) if given, then the output projection (in float8 with ``fp8_on``)."""
    o = layout.ungather_out(o_bcXH)
    return fp8.einsum("bsnh,nhd->bsd", o if gate is None else o * gate, wo, on=fp8_on, history=history)


# ----------------------------------------------------------------------------------------------
# The sublayer: forward with its residuals, and its backward


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one call (hashable: the custom_vjp's nondiff argument)."""

    cfg: ModelConfig
    groups: HeadGroups
    n: int  # chunks per device
    impl: str  # resolved: xla, blockwise, pallas or cudnn
    platform: str
    recompute: bool  # keep no output for the backward: each group's kernel forward runs again there
    kind: int = 0  # index into cfg.window_kinds: the layer's window and RoPE base

    @property
    def window(self) -> int | None:
        return self.cfg.window_kinds[self.kind]

    @property
    def scale(self) -> float:
        return self.cfg.attn_scale

    @property
    def sp(self) -> int:
        return self.groups.layout.sp

    def project(self, x, pos, w, q8=None):
        """``project_chunk`` with ``w``'s weights; with float8 their ``fp8.Quantized`` forms ``q8`` (``w``'s arrays
        then carry the gradients: ``fp8.carry``)."""
        return project_chunk(x, pos, fp8.carry(w, q8 or {}), cfg=self.cfg, local=self.window is not None)

    def out_proj(self, o, wo, gate=None, hist=None):
        return output_chunk(o, wo, gate, layout=self.groups.layout, fp8_on=self.cfg.fp8, history=hist)

    def gate(self, x, w, q8=None):
        return gate_chunk(x, fp8.carry(w, q8 or {}), cfg=self.cfg)

    def gate_of(self, x, w: dict, q8: dict):
        """``i -> `` chunk ``i``'s output gate from ``w`` (its ``"wg"``: all heads or a group's slots; its float8
        form in ``q8``), or None without one."""
        c = x.shape[1] // self.n
        return (lambda i: self.gate(chunk(x, i, c), w, q8)) if "wg" in w else None

    def out_proj_of(self, w: dict):
        """``out_proj`` with ``w``'s float8 history of the output projection (delayed scaling), if any."""
        return functools.partial(self.out_proj, hist=fp8.row(w.get(fp8.HISTORY_KEY), 3))

    def post(self, y, scale):
        """The post-attention norm of a chunk ``y [b, c, D]`` (Gemma 3; ``scale`` at rest, float32)."""
        return rms_norm(y, norm_scale(scale, self.cfg), self.cfg.rms_eps)

    def sinks(self, wg: dict):
        """This device's heads' sinks ``[size]`` from a group's weights (``wg["sinks"]``: ``[sp * size]``), or None."""
        return jax.lax.dynamic_slice_in_dim(wg["sinks"], jax.lax.axis_index(SP) * self.groups.size, self.groups.size
                                            ) if "sinks" in wg else None

    def kernel_forward(self, q, k, v, seg, sinks=None):
        """``(o, lse)``: ``o`` in q's dtype, ``lse [b, heads, S]`` float32 (``None`` for cuDNN)."""
        if self.impl == "cudnn":
            return attention(q, k, v, causal=True, segment_ids=seg, scale=self.scale, impl="cudnn",
                             platform=self.platform, window=self.window,
                             max_documents=self.cfg.attn_max_documents), None
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)  # token indices: only the xla kernel reads them
        o, lse = ring_kernel(self.impl, self.platform, float32=False).forward(
            q, k, v, pos, pos, seg, seg, causal=True, scale=self.scale, **self.window_kw,
            **({} if sinks is None else {"sinks": sinks}))
        return o.astype(q.dtype), lse

    @property
    def window_kw(self) -> dict:
        return {} if self.window is None else {"window": self.window}

    def kernel_backward(self, q, k, v, seg, o, lse, do, sinks=None):  # (dq, dk, dv[, the sinks' gradient])
        if self.impl == "cudnn":  # no log-sum-exp to start from: its forward again
            _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg, scale=self.scale,
                                                       impl="cudnn", platform=self.platform, window=self.window,
                                                       max_documents=self.cfg.attn_max_documents), q, k, v)
            return vjp(do)
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)
        delta = jnp.einsum("bshd,bshd->bhs", o.astype(_F32), do.astype(_F32))
        grads = ring_kernel(self.impl, self.platform, float32=False).backward(
            q, k, v, pos, pos, seg, seg, do, lse, delta, causal=True, scale=self.scale, **self.window_kw)
        return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v))), *([] if sinks is None else [sink_grad(
            sinks, lse, delta)]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sublayer(spec: _Spec, x, pos, seg, w, q8):
    """``x + attention(norm(x))`` of gathered weights ``w``; with float8, ``q8``: the projections' weights as
    ``fp8.Quantized`` (gathered in float8; ``w`` holds zeros in their place, which take their gradients), else
    ``{}``."""
    return _sublayer_fwd(spec, x, pos, seg, w, q8)[0]


def _wo(w: dict, q8: dict):
    """The output projection's weights: the float8 ones if any."""
    return q8.get("wo", w["wo"])


def _sublayer_fwd(spec: _Spec, x, pos, seg, w, q8):
    groups, sp, n = spec.groups, spec.sp, spec.n
    b, s, _ = x.shape
    w_res = {k: v for k, v in w.items() if k not in q8}  # the carriers (zeros) are made again in the backward
    if spec.recompute and "post_norm" not in w and groups.count > 1:
        # no output kept: each group's output projection is added up as the group finishes, so that no [b, S, hq, H]
        # buffer of every head's output exists (one [b, s, D] buffer less at the forward's peak); the sum is kept in
        # the compute dtype (as the input's gradient over groups in the backward), then added to the residual
        def group_acc(t, acc):
            wg, qg = group_weights(w, groups, t), group_weights(q8, groups, t)
            q, k, v = fill_in(spec.project, n, sp, x, pos, wg, qg)
            o_t, _ = spec.kernel_forward(q, k, v, seg, spec.sinks(wg))
            return add_out(n, sp, o_t.astype(wg["wo"].dtype), acc, _wo(wg, qg), spec.cfg.fp8,
                           fp8.row(wg.get(fp8.HISTORY_KEY), 3), spec.gate_of(x, wg, qg))

        acc = _over_groups(groups.count, group_acc, fresh(x.shape, w["wo"].dtype, x) * 0)
        # the residual added per chunk into the sum's buffer (a plain x + acc: 13 GiB more, 8B LoRA at 2.15M tokens)
        c = s // n
        y = jax.lax.fori_loop(0, n, lambda i, y: put(y, chunk(x, i, c) + chunk(y, i, c).astype(x.dtype), i, c),
                              acc.astype(x.dtype))
        return y, (x, pos, seg, w_res, q8, None, None)
    o = row_major(fresh((b, sp * s, groups.layout.heads_per_device, spec.cfg.head_dim), w["wo"].dtype, x))
    keep_lse = spec.impl != "cudnn" and not spec.recompute
    lse = fresh((groups.count, b, groups.size, sp * s), _F32, x) if keep_lse else None

    def group(t, carry):
        o, lse = carry
        wg, qg = group_weights(w, groups, t), group_weights(q8, groups, t)
        q, k, v = fill_in(spec.project, n, sp, x, pos, wg, qg)
        o_t, lse_t = spec.kernel_forward(q, k, v, seg, spec.sinks(wg))
        o = row_major(jax.lax.dynamic_update_slice_in_dim(o, o_t.astype(o.dtype), t * groups.size, axis=2))
        return o, lse if lse is None else jax.lax.dynamic_update_slice_in_dim(lse, lse_t[None], t, axis=0)

    o, lse = _over_groups(groups.count, group, (o, lse))
    post = (lambda y: spec.post(y, w["post_norm"])) if "post_norm" in w else None
    y = fill_out(spec.out_proj_of(w), n, sp, o, x, _wo(w, q8), post, spec.gate_of(x, w, q8))
    return y, (x, pos, seg, w_res, q8, None if spec.recompute else o, lse)


def _sublayer_bwd(spec: _Spec, res, ct):
    x, pos, seg, w, q8, o, lse = res
    w = {**w, **{k: jnp.zeros(q.shape, q.dtype) for k, q in q8.items()}}  # the float8 weights' gradient carriers
    groups, sp, n = spec.groups, spec.sp, spec.n
    w32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, _F32), w)
    ct_out, dpost = ct, None  # the gradient of the output projection's result; with a post-norm, through it
    if "post_norm" in w:  # needs every head's output: refused with attn_recompute (layer_kinds.check_layers)
        ct_out, dpost = grad_post(spec.out_proj_of(w), spec.post, n, sp, o, ct, _wo(w, q8), w["post_norm"])

    def group(t, carry):
        dx, dw = carry
        wg, qg = group_weights(w, groups, t), group_weights(q8, groups, t)
        q, k, v = fill_in(spec.project, n, sp, x, pos, wg, qg)
        if o is None:  # recompute: this group's output and log-sum-exp again
            o_t, lse_t = spec.kernel_forward(q, k, v, seg, spec.sinks(wg))
        else:
            o_t = jax.lax.dynamic_slice_in_dim(o, t * groups.size, groups.size, axis=2)
            lse_t = None if lse is None else lse[t]
        hist = wg.get(fp8.HISTORY_KEY)
        gate = (functools.partial(spec.gate, q8=qg), x, {"norm": wg["norm"], "wg": wg["wg"]}, dx
                ) if "wg" in wg else None
        do, dwo, dhist, gated = grad_out(n, sp, o_t, ct_out, _wo(wg, qg), spec.cfg.fp8, fp8.row(hist, 3), gate)
        if gated is not None:  # the gate's gradient already sent through its norm and projection onto dx
            dx, dgate = gated
        grads = spec.kernel_backward(q, k, v, seg, o_t, lse_t, do, spec.sinks(wg))
        w_in = {name: a for name, a in wg.items() if name not in ("wo", "sinks", "wg")}
        dx, dwg = grad_in(spec.project, n, sp, x, pos, w_in, grads[:3], dx, qg)
        if gated is not None:
            dwg["norm"] = dwg["norm"] + dgate["norm"]
            dwg["wg"] = dgate["wg"]
        if hist is not None:  # q, k, v's new histories from their projections, o's from its backward here
            dwg[fp8.HISTORY_KEY] = dwg[fp8.HISTORY_KEY].at[3].max(dhist)
        if "sinks" in wg:  # this device's heads' share of the group's slots; shard_map sums over devices
            dwg["sinks"] = jnp.zeros(wg["sinks"].shape, _F32).at[jax.lax.axis_index(SP) * groups.size + jnp.arange(
                groups.size)].set(grads[3].astype(_F32))
        (dw_t,) = jax.linear_transpose(lambda w: group_weights(w, groups, t), w32)({**dwg, "wo": dwo})
        return dx, sum_f32(dw, dw_t)

    dx, dw = _over_groups(groups.count, group, (ct, zeros_f32(w)))
    if dpost is not None:
        dw = {**dw, "post_norm": dw["post_norm"] + dpost}
    return dx, None, None, cast_like(dw, w), None


_sublayer.defvjp(_sublayer_fwd, _sublayer_bwd)


# ----------------------------------------------------------------------------------------------
# The sublayer on global arrays


def check_tiled_attention(chunk: int, mesh: Mesh, local_seq: int, flag: str = "attn_chunk") -> int:
    """The number of chunks; raises ``ValueError`` for a mesh with a ring or a chunk that does not divide."""
    if mesh.shape[RING] > 1:
        raise ValueError(f"{flag} ({chunk}) tiles the Ulysses exchange of a mesh without a ring, but this mesh has "
                         f"ring = {mesh.shape[RING]}; set {flag} to 0 with a ring")
    return local_chunks(chunk, local_seq, flag)


def tiled_attention(x_BSD, positions_BS, segment_ids_BS, params: dict, *, cfg: ModelConfig, mesh: Mesh,
                    chunk: int, head_chunk: int = 0, recompute: bool = False, kind: int = 0,
                    ready: dict | None = None) -> jax.Array:
    """``x + attention(rms_norm(x))`` of one layer (global arrays, ``x [B, S, D]`` sequence-sharded), tiled as in
    the module doc: ``chunk`` tokens of each device's sequence per chunk, ``head_chunk`` query heads of each
    device per group (0: one group); ``recompute``: keep no output for the backward. ``params``: the layer's
    attention parameters by the names of ``PARAMS`` (``"norm"`` is the pre-attention RMSNorm's scale, ``"post_norm"``
    Gemma 3's post-attention one: ``x + post_norm(attention(norm(x)))``; absent optional ones are left out), in the
    compute dtype (the norm scales in float32) and at-rest layout. ``ready``: q, k, v, o quantised before the layer
    loop by ``FLOAT8`` names (``fp8_stack``; no ``qt``: head groups cut ``q``), taken instead of quantising here."""
    sp = mesh.shape[SP]
    n = check_tiled_attention(chunk, mesh, x_BSD.shape[1] // sp)
    platform = device_platform(mesh)
    impl = resolve_impl(cfg.attention_impl, dtype=cfg.compute_jnp_dtype, head_dim=cfg.head_dim,
                        has_segment_ids=segment_ids_BS is not None, platform=platform, sinks="sinks" in params)
    groups = head_groups(plan_heads(cfg.num_heads, cfg.num_kv_heads, sp), head_chunk)
    spec = _Spec(cfg, groups, n, impl, platform, recompute, kind)
    over_data = cfg.shard_params_over_data
    if fp8.HISTORY_KEY in params:  # one copy per device: the copies' new values meet in a max (fp8.per_device)
        params = {**params, fp8.HISTORY_KEY: fp8.per_device(params[fp8.HISTORY_KEY], mesh)}
    names = sorted(params)
    w_specs = [fp8.DEVICE_SPEC if k == fp8.HISTORY_KEY else param_spec(PARAMS[k][0], over_data=over_data)
               for k in names]
    act, tok = P((DATA, FSDP), SEQ, None), P((DATA, FSDP), SEQ)
    ready = ready or {}  # whole weights (fp8_stack applies to unsplit ones alone): replicated
    ready_specs = {k: fp8.replicated(q) for k, q in ready.items()}

    def local(x, pos, seg, ready, *ws):
        at_rest = dict(zip(names, ws))
        hist = at_rest[fp8.HISTORY_KEY][0] if fp8.HISTORY_KEY in at_rest else None  # this device's copy
        w, q8 = {}, {}
        for k, v in at_rest.items():
            axis = PARAMS[k][1]
            if axis is None:  # whole on every device (the history: this device's copy, taken above)
                w[k] = hist if k == fp8.HISTORY_KEY else v
                continue
            gather = functools.partial(jax.lax.all_gather, axis_name=fsdp_axes(over_data), axis=axis, tiled=True)
            if cfg.fp8 and k in FLOAT8:  # quantised where it rests, gathered in float8; zeros take its gradient
                q8[k] = ready[k] if k in ready else fp8.prequantize(v, fp8.row(hist, FLOAT8.index(k)),
                                                                    axes=fsdp_axes(over_data), gather=gather)
                w[k] = fp8.grad_carrier(v, gather)
            else:
                w[k] = gather(v)
        if cfg.attn_output_gate:  # each head's [q | gate] (model.Attention's wq), gathered: the gate's own weights
            w["wq"], w["wg"] = jnp.split(w["wq"], 2, axis=-1)
            if q8:
                qa, qb = jnp.split(q8["wq"].q, 2, axis=-1)
                q8["wq"], q8["wg"] = dataclasses.replace(q8["wq"], q=qa), dataclasses.replace(q8["wq"], q=qb)
        if seg is not None:
            seg = jax.lax.all_gather(seg, SP, axis=1, tiled=True)  # [b, S]
        return _sublayer(spec, x, pos, seg, w, q8)

    has_seg = segment_ids_BS is not None
    args = [x_BSD, positions_BS, ready, *([segment_ids_BS] if has_seg else []), *(params[k] for k in names)]
    specs = [act, tok, ready_specs, *([tok] if has_seg else []), *w_specs]

    def body(x, pos, ready, *rest):
        return local(x, pos, rest[0], ready, *rest[1:]) if has_seg else local(x, pos, None, ready, *rest)

    # the custom rules and the kernels carry no varying-manual-axes types
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=act, check_vma=False)
    return fn(*args)
