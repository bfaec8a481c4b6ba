"""The gated delta-net sublayer (the "linear" layers of Qwen3.5 and Qwen3-Next): projections, the Ulysses exchange,
the gated RMSNorm and the output projection.

Per layer, on the normed input ``x [B, S, D]`` (sequence-split over ``sp``, like every activation)::

    q, k = x W_q, x W_k  [B, S, Hk, dk]    v, z = x W_v, x W_z  [B, S, Hv, dv]    b, a = x W_b, x W_a  [B, S, Hv]
                                                   (the backward: one GEMM for x's gradient, ``project``)
    o = ulysses_gated_delta(q, k, v, a, b, ...)        the exchange, conv, gates and rule on whole sequences
    y = rms_norm(o) * w_norm * silu(z)                 per token and head (Qwen3NextRMSNormGated: over dv, plain w)
    out = y W_o                                        [B, S, D]

The parameters are stored per head (``wq_DJQ [D, Hk, dk]``, ``wv_DUW [D, Hv, dv]``, ..., the convolution's filters
``conv_v_UWC [Hv, dv, K]``, ``a_log_U``, ``dt_bias_U [Hv]``, ``wo_UWD [Hv, dv, D]``), so that a head's weights are one
slice of each: the exchange hands each device whole heads, and each takes its own heads' filters and gates
(``parallel/ulysses_delta.py``). Like every weight they are FSDP-split at rest over their ``embed`` dimension (the
filters, gates and norm, which have none, whole) and gathered where they are used.

Head groups (``ModelConfig.delta_head_chunk = m``: value heads per device in a group). The exchanged whole sequences
of a device's heads (``[b, S, 2 kl dk + vl dv + 2 vl]``, several copies in the backward) are what fills a device at
the longest contexts. With ``m`` set, the sublayer runs ``vl / m`` groups in a ``lax.scan``, each the whole sublayer
for ``m`` value heads per device (and the key heads they read: ``m / n`` of them, ``n = Hv / Hk``, or, with ``m < n``,
the one key head, projected and exchanged again for each group that reads it), its body rematerialised: the forward
and the backward hold one group's whole-sequence buffers at a time, and the output projections add up over the
groups. ``m`` must divide ``vl`` and be a multiple or a divisor of ``n``. The layer's input norm runs inside each
group too (``norm=``), so the backward keeps the raw input only. LoRA's terms: the input projections' are computed
whole and cut per group; ``out_proj``'s adapter is cut by its rows (its dropout draws its mask per group).

What held a device at the longest contexts (Qwen3.5-9B on 8 compile-only H100s at 8,388,608 tokens, sp = 8, one
value head per group; XLA's live ranges, ``plan/peak.py``), and what was done (114.5 -> 67.9 GiB in all): the gradient
of ``x`` was six ``[S/sp, D]`` arrays, one per projection, summed after (``project``: one GEMM); the convolution's
gradient, the gated norm's gradient of ``z`` and ``silu(z)`` were kept in float32 across the rule's backward (rounded
where made: ``kernels/short_conv.py``, ``gated_rms_norm``); the convolution's output was kept for the rule's backward
(recomputed now: ``parallel/ulysses_delta.py``). ``experiments/results/plan_hybrid_h100.md`` has each step.

``z`` never crosses the exchange: the gated norm needs, for one token and one head, that head's output and ``z`` of
the same token and head, both on the sequence-split side once the output has come back. Shapes follow the model's
letters (``model/transformer.py``) with ``J`` key heads, ``U`` value heads, ``Q`` / ``W`` their head dims and ``C``
the filter length.

Float8 (``--fp8``, ``model/fp8.py``): q, k, v and z run as one float8 GEMM on their weights side by side (one scale
for the four, the gradient one more), the output projection in float8; b and a stay in the compute dtype; current
scaling under either recipe (a history would be shared by the head groups). With LoRA the frozen weights rest in
float8 (``fp8_base``, q, k, v and z with one amax per layer), cut per head group as they are (``cut_frozen``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.model import fp8, fp8_base, lora
from ulysses_jax.model.layers import Gather, ParamMaker, use
from ulysses_jax.parallel.mesh import RING, SP
from ulysses_jax.parallel.sharding import constrain, row_major
from ulysses_jax.parallel.ulysses_delta import plan_delta_heads, ulysses_gated_delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gated_rms_norm(o, z, w, eps: float):
    """``rms_norm(o) * w * silu(z)`` over the last axis (a value head's ``dv``), float32 inside, ``o``'s dtype out.
    Its own backward: it keeps ``o`` and ``z`` only, recomputes the float32 intermediates, and returns the gradients
    of ``o`` and ``z`` in their own dtypes (autodiff kept float32 copies, each ``[B, S/sp, Hv, dv]``, twice the size of
    ``o``: the gradient of ``z`` in float32 lived from the norm's backward to the projections', across the whole
    delta rule's backward)."""
    return _gated_norm_parts(o, z, w, eps)[0]


def _gated_norm_parts(o, z, w, eps):
    """``(y, n, r, gate)``: the output, ``o`` normalised and its ``rsqrt`` (float32), ``silu(z)`` (float32)."""
    o32 = o.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    n, gate = o32 * r, jax.nn.silu(z.astype(jnp.float32))
    return (n * w.astype(jnp.float32) * gate).astype(o.dtype), n, r, gate


def _gated_norm_fwd(o, z, w, eps):
    return gated_rms_norm(o, z, w, eps), (o, z, w)


def _gated_norm_bwd(eps, res, dy):
    o, z, w = res
    _, n, r, gate = _gated_norm_parts(o, z, w, eps)
    g, w32 = dy.astype(jnp.float32), w.astype(jnp.float32)
    sig = jax.nn.sigmoid(z.astype(jnp.float32))
    dz = g * n * w32 * sig * (1 + z.astype(jnp.float32) * (1 - sig))  # silu'(z) = sig (1 + z (1 - sig))
    dn = g * w32 * gate
    do = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dw = jnp.sum(g * n * gate, axis=tuple(range(o.ndim - 1)))
    # all three made before any is used, do and dz rounded to their inputs' dtypes there: left free, XLA kept silu(z)
    # and sigmoid(z) in float32 for dw's sum, scheduled after the delta rule's backward
    return jax.lax.optimization_barrier((do.astype(o.dtype), dz.astype(z.dtype), dw.astype(w.dtype)))


gated_rms_norm.defvjp(_gated_norm_fwd, _gated_norm_bwd)


@jax.custom_vjp
def project(x, ws):
    """``x [B, S, D]`` times each ``w [D, n_i]`` of ``ws``: a tuple of ``[B, S, n_i]``, one GEMM each (as transformers
    computes them: the same float32 sums). The backward is one GEMM for the input's gradient, on the output
    gradients and the weights side by side: autodiff formed one ``[B, S/sp, D]`` gradient per projection and summed
    them after, six such arrays alive at once, what filled a device at the longest contexts (module doc)."""
    return tuple(jnp.einsum("bsd,dn->bsn", x, w) for w in ws)


def _project_fwd(x, ws):
    return project(x, ws), (x, ws)


def _project_bwd(res, ds):
    x, ws = res
    d, w = jnp.concatenate(ds, axis=-1), jnp.concatenate(ws, axis=1)
    dw = jnp.einsum("bsd,bsn->dn", x, d)
    return jnp.einsum("bsn,dn->bsd", d, w), tuple(jnp.split(dw, np.cumsum([a.shape[1] for a in ws])[:-1], axis=1))


project.defvjp(_project_fwd, _project_bwd)


# --fp8: the delta-net's projections in float8 (current scaling under either recipe): q, k, v and z as one GEMM on
# their weights side by side, and the output projection; b and a (a few columns each, into the gates) stay as they are
FP8_WEIGHTS = ("wq_DJQ", "wk_DJQ", "wv_DUW", "wz_DUW", "wo_UWD")
QKVZ = "qkvz"  # q, k, v and z's weights side by side ([D, n]) as the one GEMM reads them (``fp8_stack``'s key)


def cut_frozen(w: fp8.Quantized, idx, axis: int) -> fp8.Quantized:
    """A float8 weight at rest (``fp8_base``) cut to heads ``idx`` on ``axis`` of its ``[in..., out...]`` copy (the
    same heads of its ``[out..., in...]`` copy), or whole (``idx`` None)."""
    if idx is None:
        return w
    axis_t = 0 if axis == 1 else 1  # q, k, v, z [D, H, d] -> [H, d, D]; the output's [U, W, D] -> [D, U, W]
    return fp8.Quantized(jnp.take(w.q, idx, axis=axis), w.scale, w.amax, w.dtype, jnp.take(w.qt, idx, axis=axis_t))


def side_by_side(ws: list[fp8.Quantized], dt) -> fp8.Quantized:
    """The q, k, v and z weights at rest in float8 (one scale: ``fp8_base.SHARED``) as one ``[D, n]`` weight, its
    ``[n, D]`` copy beside it."""
    return fp8.Quantized(jnp.concatenate([g.q.reshape(g.q.shape[0], -1) for g in ws], axis=1), ws[0].scale,
                         ws[0].amax, dt, jnp.concatenate([g.qt.reshape(-1, g.qt.shape[-1]) for g in ws], axis=0))


def check_mesh(cfg, mesh) -> None:
    """A model with delta-net layers on ``mesh``: no ring, and heads that split over ``sp`` (one line otherwise)."""
    if mesh.shape.get(RING, 1) > 1:
        raise ValueError(f"{cfg.name} has gated delta-net ('linear') layers, which do not run with a ring "
                         f"(--mesh.ring {mesh.shape[RING]}): their recurrence would pass its state around the ring; "
                         f"use --mesh.ring 1 and sp for the sequence")
    group_heads(cfg, mesh.shape[SP])  # the heads split over sp, and into groups of delta_head_chunk


def describe(cfg, mesh) -> str:
    """The start-up line of a hybrid: its layers of each kind and how the delta-net's heads split over ``sp``."""
    layout = plan_delta_heads(cfg.linear_num_key_heads, cfg.linear_num_value_heads, mesh.shape[SP])
    copies = f", key heads copied to {layout.sp // cfg.linear_num_key_heads} devices" if layout.copies_keys else ""
    linear, full = len(cfg.linear_layers), len(cfg.attention_layers)
    return (f"{linear} gated delta-net layer{'s' * (linear != 1)} (linear attention: {cfg.linear_num_key_heads} key "
            f"/ {cfg.linear_num_value_heads} value heads of {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}, "
            f"{layout.kl} / {layout.vl} per device on sp={layout.sp}{copies}; the chunked delta rule in XLA ops, its "
            f"walk over chunks {'in Pallas kernels' if cfg.delta_impl == 'pallas' else 'a lax.scan'}, "
            f"{'bf16 products' if cfg.delta_precision == 'bf16' else 'float32 products'}) and "
            f"{full} full-attention layer{'s' * (full != 1)} (output-gated, RoPE on {cfg.rotary_dim} of "
            f"{cfg.head_dim} dims); each layer stores its own mixer's parameters only")


def shapes(cfg) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    """Each delta-net parameter: ``(shape, logical axes, init)``."""
    d, hk, hv = cfg.hidden, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
    heads = ("embed", "linear_heads", "linear_dim")
    return {
        "wq_DJQ": ((d, hk, dk), heads, "normal"), "wk_DJQ": ((d, hk, dk), heads, "normal"),
        "wv_DUW": ((d, hv, dv), heads, "normal"), "wz_DUW": ((d, hv, dv), heads, "normal"),
        "wb_DU": ((d, hv), ("embed", "linear_heads"), "normal"),
        "wa_DU": ((d, hv), ("embed", "linear_heads"), "normal"),
        "conv_q_JQC": ((hk, dk, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "conv_k_JQC": ((hk, dk, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "conv_v_UWC": ((hv, dv, c), ("linear_heads", "linear_dim", "conv"), "normal"),
        "a_log_U": ((hv,), ("linear_heads",), "log_uniform"), "dt_bias_U": ((hv,), ("linear_heads",), "ones"),
        "norm_W": ((dv,), ("linear_dim",), "ones"),
        "wo_UWD": ((hv, dv, d), ("linear_heads", "linear_dim", "embed"), "normal"),
    }


class DeltaNet(nnx.Module):
    """The delta-net parameters of a layer (stacked over the layers like every block parameter; ``shapes``)."""

    def __init__(self, make: ParamMaker):
        self.cfg, self.mesh = make.cfg, make.mesh
        for name, (shape, names, init) in shapes(self.cfg).items():
            setattr(self, name, make(f"delta.{name.rsplit('_', 1)[0]}", shape, names, init=init))

    def __call__(self, x_BSD, segment_ids_BS, adapters=None, drop=None, norm=None, ready=None):
        """The sublayer's output ``[B, S, D]`` for its input (module doc). ``adapters``: LoRA's ``{target: (A, B)}``
        (``lora.pairs(block, "delta")``), ``drop`` its dropout's ``(key, token ids)``. ``norm``: the layer's
        input norm, applied here to the raw input ``x_BSD``; in head groups each group norms it again, so that no
        normed copy of the device's sequence (``[B, S/sp, D]``) outlives the forward (LoRA's terms, computed whole,
        still take one). ``ready``: this layer's float8 weights quantised before the layer loop (``fp8_stack``:
        ``{QKVZ: ..., "wo_UWD": ...}``, without head groups), or None."""
        cfg, mesh, dt = self.cfg, self.mesh, self.cfg.compute_jnp_dtype
        frozen = fp8_base.frozen(self, FP8_WEIGHTS[0])

        def weight(name):
            if frozen and name in FP8_WEIGHTS:  # LoRA's base rests in float8 already (fp8_base): gathered as it is
                return fp8_base.gathered(self, name, mesh, dt)
            if cfg.fp8 and name in FP8_WEIGHTS:  # --fp8: left at rest here, quantised before its gather
                return getattr(self, name).get_value().astype(dt)
            return use(getattr(self, name), mesh, jnp.float32 if name in ("a_log_U", "dt_bias_U", "norm_W") else dt)

        w = {name: weight(name) for name in shapes(cfg)}
        whole = Gather(NamedSharding(mesh, P()))  # a weight's gather (every delta-net weight is whole in use)
        norm = norm or (lambda x: x)
        keys, values = group_heads(cfg, mesh.shape[SP])
        grouped = len(keys) > 1
        # the normed input, once: for the whole sublayer, and for LoRA's terms (in groups each group norms again)
        x_in = norm(x_BSD) if adapters or not grouped else x_BSD
        qkv = lora.low_rank(x_in, adapters, "in_proj_qkv", cfg.lora, drop)  # one adapter over q, k, v (Qwen3.5's)
        terms = dict(zip(("q", "k", "v"), [None] * 3 if isinstance(qkv, int) else lora.split_fused(
            qkv, [w[n].shape[-2:] for n in ("wq_DJQ", "wk_DJQ", "wv_DUW")])))
        for name, target in (("z", "in_proj_z"), ("b", "in_proj_b"), ("a", "in_proj_a")):
            term = lora.low_rank(x_in, adapters, target, cfg.lora, drop)
            terms[name] = None if isinstance(term, int) else term
        out_ad = adapters.get("out_proj") if adapters else None

        def mix(x, heads=None):
            """The sublayer on the normed input over the key and value heads ``heads`` (global indices,
            ``group_heads``), or all."""
            key, val = (None, None) if heads is None else heads
            x = row_major(x, mesh)  # (as each layer's input: its weight gradients' GEMMs read it transposed)

            def cut(a, axis, idx):  # a head group's slice of a weight (or LoRA term); the whole of it without groups
                return a if idx is None else jnp.take(a, idx, axis=axis)

            used = (("q", "wq_DJQ", key), ("k", "wk_DJQ", key), ("v", "wv_DUW", val), ("z", "wz_DUW", val),
                    ("b", "wb_DU", val), ("a", "wa_DU", val))
            ws = [cut_frozen(w[name], idx, 1) if frozen and name in FP8_WEIGHTS else cut(w[name], 1, idx)
                  for _, name, idx in used]
            if cfg.fp8:  # q, k, v, z side by side, one float8 GEMM (one scale each for x, the weights, dy); b, a not
                side = side_by_side(ws[:4], dt) if frozen else jnp.concatenate(
                    [a.reshape(a.shape[0], -1) for a in ws[:4]], axis=1)
                # quantised before the layer loop where fp8_stack applies: the weights carry the gradient
                y = fp8.einsum("bsd,dn->bsn", x, fp8.carried(side, ready, QKVZ), on=True, gather=whole)
                flat = (*jnp.split(y, np.cumsum([math.prod(a.shape[1:]) for a in ws[:3]]), axis=-1),
                        *project(x, tuple(a.reshape(a.shape[0], -1) for a in ws[4:])))
            else:
                flat = project(x, tuple(a.reshape(a.shape[0], -1) for a in ws))
            got = {}
            for (letter, _, idx), wt, piece in zip(used, ws, flat):
                piece = piece.reshape(*piece.shape[:2], *wt.shape[1:])
                if terms[letter] is not None:  # LoRA's term of these heads
                    piece = piece + cut(terms[letter], 2, idx)
                got[letter] = constrain(piece, mesh, ("batch", "seq") + (None,) * (piece.ndim - 2))
            q, k, v, z, b, a = (got[letter] for letter in "qkvzba")
            conv = [cut(w[n], 0, idx) for n, idx in (("conv_q_JQC", key), ("conv_k_JQC", key), ("conv_v_UWC", val))]
            o = ulysses_gated_delta(q, k, v, a, b, *conv, cut(w["a_log_U"], 0, val), cut(w["dt_bias_U"], 0, val),
                                    mesh=mesh, axis_name=SP, ring_axis=RING, segment_ids=segment_ids_BS,
                                    precision=cfg.delta_precision, impl=cfg.delta_impl)
            y = gated_rms_norm(constrain(o, mesh, ("batch", "seq", None, None)), z, w["norm_W"], cfg.rms_eps)
            wo = fp8.carried(cut_frozen(w["wo_UWD"], val, 0) if frozen else cut(w["wo_UWD"], 0, val), ready, "wo_UWD")
            out = fp8.einsum("bsuw,uwd->bsd", y, wo, on=cfg.fp8, gather=whole if cfg.fp8 and not frozen else None)
            if out_ad is not None:  # the adapter's rows of these heads
                out = out + lora.low_rank(y, {"out_proj": (cut(out_ad[0], 0, val), out_ad[1])}, "out_proj",
                                          cfg.lora, drop)
            return constrain(out, mesh, ("batch", "seq", "embed"))

        if not grouped:
            return mix(x_in)
        # each group's forward (its norm included) again in its backward: one group's buffers at a time
        body = jax.checkpoint(lambda x, heads: mix(norm(x), heads))

        def step(acc, heads):  # summed in the compute dtype, as a tensor-parallel all-reduce sums its partial outputs
            return acc + body(x_BSD, heads), None

        acc = constrain(jnp.zeros(x_BSD.shape, x_BSD.dtype), mesh, ("batch", "seq", "embed"))
        return jax.lax.scan(step, acc, (jnp.asarray(keys), jnp.asarray(values)))[0]


def group_heads(cfg, sp: int) -> tuple[np.ndarray, np.ndarray]:
    """``(keys [G, sp * kg], values [G, sp * m])``: the global key and value heads of each head group (module doc;
    ``m = cfg.delta_head_chunk`` value heads per device, ``kg`` key heads), device by device, in the order the
    exchange hands them out. One group (``G = 1``) when ``m`` is 0 or a device's whole share. ``ValueError`` for an
    ``m`` that does not split a device's heads."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    layout = plan_delta_heads(hk, hv, sp)
    vl, n = layout.vl, hv // hk
    m = cfg.delta_head_chunk or vl
    if vl % m or (m % n and n % m):
        fits = [d for d in range(1, vl + 1) if vl % d == 0 and (d % n == 0 or n % d == 0)]
        raise ValueError(f"delta_head_chunk ({m}) must divide the {vl} delta-net value heads each device computes "
                         f"(sp={sp}) and be a multiple or a divisor of the {n} value heads per key head; use one of "
                         f"{', '.join(map(str, fits))}")
    kg = max(1, m // n)
    keys = [[(p * vl + t * m) // n + i for p in range(sp) for i in range(kg)] for t in range(vl // m)]
    values = [[p * vl + t * m + j for p in range(sp) for j in range(m)] for t in range(vl // m)]
    return np.asarray(keys, np.int32), np.asarray(values, np.int32)
