"""The dense MLP sublayer: SwiGLU (GeGLU for Gemma 3), plain or tiled over chunks of each device's local sequence.

``mlp_chunk`` (``ModelConfig``) runs the sublayer (norm, MLP, residual add) over sequence chunks of each device's local
sequence inside ``shard_map`` (so chunking never moves activations between devices), each chunk rematerialised
(``chunked.chunk_map``). The sparse MLP (mixture of experts) is ``moe.py``. With ``fp8`` the three products run in
float8 (``fp8.py``), LoRA's terms beside them as they are. The untiled MLP names its gate and up products
(``MLP_GATE``, ``MLP_UP``: LoRA's terms added), which remat keeps with ``mlp_keep`` (``transformer.remat_policy``).
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.model import fp8, fp8_base, lora
from ulysses_jax.model.chunked import chunk_map
from ulysses_jax.model.config import local_chunks
from ulysses_jax.model.layers import ParamMaker, RMSNorm, mlp_activation, norm_scale, rms_norm, use_parts
from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ
from ulysses_jax.parallel.sharding import constrain, fsdp_axes, gather_param, param_spec

MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"


def swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD, act=jax.nn.silu, adapters=None, lora_cfg=None, drop=None,
           fp8_on: bool = False, history=None, gathers=None):
    """The gated MLP: SwiGLU with ``act = silu``, GeGLU with a GELU (Gemma 3). ``adapters``: LoRA's ``{target: (A, B)}``
    on gate, up, down (``lora.low_rank`` with ``lora_cfg`` and dropout's ``drop``). ``fp8_on``: the three products in
    float8 (``fp8.einsum``; ``history [3, 3, HISTORY]``: gate, up, down's with delayed scaling); adapters stay as they
    are. ``gathers``: the three weights are at rest and gathered here (``layers.use_parts``; in float8 with
    ``fp8_on``)."""
    adapted = functools.partial(lora.low_rank, adapters=adapters, lora=lora_cfg, drop=drop)  # LoRA's terms, or 0

    def mm(x, w, i):
        return fp8.einsum("bsd,df->bsf", x, w, on=fp8_on, history=fp8.row(history, i),
                          gather=None if gathers is None else gathers[i])

    gate_BSF = checkpoint_name(mm(x_BSD, w_gate_DF, 0) + adapted(x_BSD, target="gate"), MLP_GATE)
    h_BSF = act(gate_BSF) * checkpoint_name(mm(x_BSD, w_up_DF, 1) + adapted(x_BSD, target="up"), MLP_UP)
    return mm(h_BSF, w_down_FD, 2) + adapted(h_BSF, target="down")


def tiled_swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD, *, mesh: Mesh, chunk: int, over_data: bool,
                 norm: tuple[jax.Array, float] | None = None, post_norm: jax.Array | None = None,
                 activation=jax.nn.silu, adapters=None, lora_cfg=None, drop=None, fp8_on: bool = False,
                 history=None, ready=None):
    """SwiGLU over chunks of ``chunk`` tokens of each device's local sequence, each chunk rematerialised.

    Runs in ``shard_map``: the input stays ``[B/(data*fsdp), S/sp, D]`` per device and is cut locally, so
    chunking moves nothing between devices. Weights arrive in their at-rest layout and are all-gathered
    here (the FSDP gather; its transpose is the reduce-scatter of the gradient). Only one chunk's
    ``[b, chunk, F]`` intermediates exist at a time, forward and backward (``chunked.chunk_map``: each chunk
    recomputed in the backward).

    ``norm=(scale, eps)``: the whole sublayer ``x + swiglu(rms_norm(x))`` per chunk (``scale`` at rest), so that
    neither the normed input nor its gradient exists for the whole local sequence. ``post_norm`` (a scale at rest, with
    ``norm``; Gemma 3): ``x + rms_norm(swiglu(rms_norm(x)), post_norm)`` per chunk, the MLP's output normed before the
    residual add as in the plain block.

    ``adapters`` (LoRA, ``lora_cfg``): ``{target: (A, B)}`` at rest; then only they are differentiated (the weights and
    norm scales are the frozen base), and ``drop`` (``(key, token ids [B, S])``) is LoRA's dropout while training.

    ``fp8_on``: the products in float8, each chunk's activations scaled on their own; ``history`` (delayed scaling,
    ``[3, 3, HISTORY]``) rides with the differentiated weights, a copy per device (``fp8.per_device``). Trained weights
    are quantised where they rest and gathered in float8, once per call (``fp8.prequantize``, their gradients through
    ``fp8.Carried``); LoRA's frozen base arrives in float8 already (``fp8.Quantized`` with both layouts, ``fp8_base``)
    and is gathered as it is. ``ready`` (``fp8_stack``: weights not split, quantised before the layer loop):
    ``{"w_gate_DF": fp8.Quantized, ...}`` taken instead of quantising here. The chunks, forward and backward, take the
    float8 weights as they are.
    """
    if post_norm is not None and norm is None:
        raise ValueError("post_norm tiles the whole sublayer x + post_norm(mlp(norm(x))); pass norm too")
    wa = fsdp_axes(over_data)
    act = P((DATA, FSDP), SEQ, None)
    base = dict(g=w_gate_DF, u=w_up_DF, d=w_down_FD, norm=None if norm is None else norm[0], post=post_norm)
    base = {k: v for k, v in base.items() if v is not None}
    base_specs = dict(g=P(wa, None), u=P(wa, None), d=P(None, wa), norm=P(wa), post=P(wa))
    for k, w in base.items():  # LoRA's base in float8 at rest (fp8_base): both copies where they rest
        if isinstance(w, fp8.Quantized):
            names = ("mlp", "embed") if k == "d" else ("embed", "mlp")
            q, qt = (fp8_base.rest_spec(a.shape, n, mesh, over_data) for a, n in ((w.q, names), (w.qt, names[::-1])))
            base_specs[k] = fp8.Quantized(q, P(), P(), w.dtype, qt)
    lora_mode = adapters is not None
    adapters = adapters or {}
    # an adapter matrix at rest is split over the FSDP axes on its embed dimension, if it has one
    ad_specs = {t: (_rest_spec(t, "a", over_data), _rest_spec(t, "b", over_data)) for t in adapters}
    key, ids = drop if drop is not None else (None, None)  # given only while training with dropout
    hist = None if history is None else fp8.per_device(history, mesh)
    ready = {k: ready[a] for k, a in zip("gud", ATTRS)} if ready else {}  # whole weights: replicated specs
    ready_specs = {k: fp8.replicated(q) for k, q in ready.items()}

    def gather(w, spec):
        axes = [i for i, e in enumerate(spec) if e is not None]
        return gather_param(w, axes[0], over_data=over_data) if axes else w

    def sublayer(xc, ad, ws, ids_c):  # one chunk: [x +] [post_norm](mlp([norm](x)))
        d = None if ids_c is None else (ws["key"], ids_c)
        h = rms_norm(xc, ws["norm"], norm[1]) if norm else xc
        hc = (ad or ws).get(fp8.HISTORY_KEY)  # the history rides with whatever is differentiated
        y = swiglu(h, ws["g"], ws["u"], ws["d"], act=activation, adapters=ad, lora_cfg=lora_cfg, drop=d, fp8_on=fp8_on,
                   history=hc)
        if not norm:
            return y
        return xc + (rms_norm(y, ws["post"], norm[1]) if post_norm is not None else y)

    def local(x_bsD, ids_bs, key, base, adapters, hist, ready):
        quantized = {}  # float8: the projections' weights quantised where they rest, gathered in float8 once
        for i, k in enumerate("gud" if fp8_on else ""):
            to_whole = functools.partial(gather, spec=base_specs[k])
            w = base.pop(k)
            if isinstance(w, fp8.Quantized):  # float8 at rest: gathered as it is
                s = base_specs[k]
                quantized[k] = fp8.Quantized(gather(w.q, s.q), w.scale, w.amax, w.dtype, gather(w.qt, s.qt))
                continue
            quantized[k] = ready[k] if k in ready else fp8.prequantize(
                w, fp8.row(None if hist is None else hist[0], i), axes=wa, gather=to_whole)
            if not lora_mode:  # trained: zeros of the gathered shape carry the gradient back through the transpose
                base[k] = fp8.grad_carrier(w, to_whole)
        base = {k: w if k in quantized else gather(w, base_specs[k]) for k, w in base.items()}
        adapters = {t: tuple(gather(m, sp) for m, sp in zip(pair, ad_specs[t])) for t, pair in adapters.items()}
        if hist is not None:  # this device's copy, beside the differentiated weights
            (adapters if lora_mode else base)[fp8.HISTORY_KEY] = hist[0]
        n = local_chunks(chunk, x_bsD.shape[1], "mlp_chunk")
        if lora_mode:  # only the adapters train: the base rides along as frozen, no gradient formed for it
            return chunk_map(sublayer, n, x_bsD, adapters, {**base, **quantized, "key": key}, ids_bs)
        if quantized:  # the float8 weights ride as frozen, their carriers are differentiated

            def carried(xc, ws, q, _):
                return sublayer(xc, None, {**ws, **{k: fp8.Carried(ws[k], w) for k, w in q.items()}}, None)

            return chunk_map(carried, n, x_bsD, base, quantized)
        return chunk_map(lambda xc, ws: sublayer(xc, None, ws, None), n, x_bsD, base)

    specs = (act, None if ids is None else P((DATA, FSDP), SEQ), None if key is None else P(),
             {k: base_specs[k] for k in base}, ad_specs, None if hist is None else fp8.DEVICE_SPEC, ready_specs)
    # chunk_map's backward carries no varying-manual-axes types
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=act, check_vma=False)
    return fn(x_BSD, ids, key, base, adapters, hist, ready)


def _rest_spec(target: str, side: str, over_data: bool) -> P:
    """The at-rest spec of an MLP adapter matrix, as ``lora.Adapters`` makes it: ``A`` takes the weight's input axis,
    ``B`` its output axis (gate/up ``[D, F]``, down ``[F, D]``), the rank axis whole."""
    w_names = ("mlp", "embed") if target == "down" else ("embed", "mlp")
    return param_spec((w_names[0], None) if side == "a" else (None, w_names[1]), over_data=over_data)


ATTRS = ("w_gate_DF", "w_up_DF", "w_down_FD")


class MLP(nnx.Module):
    def __init__(self, make: ParamMaker):
        self.cfg, self.mesh = make.cfg, make.mesh
        d, f = self.cfg.hidden, self.cfg.mlp_dim
        self.w_gate_DF = make("mlp.w_gate", (d, f), ("embed", "mlp"))
        self.w_up_DF = make("mlp.w_up", (d, f), ("embed", "mlp"))
        self.w_down_FD = make("mlp.w_down", (f, d), ("mlp", "embed"))
        if (history := fp8.make_history(self.cfg, make.mesh, 3, make.stack)) is not None:  # gate, up, down
            self.fp8_history = history

    def residual_tiled(self, x_BSD, norm: RMSNorm, post_norm: RMSNorm | None = None, adapters=None, drop=None,
                       ready=None):
        """``x + mlp(norm(x))`` per chunk of ``mlp_chunk`` tokens (``tiled_swiglu`` with ``norm``); with
        ``post_norm`` (Gemma 3) ``x + post_norm(mlp(norm(x)))``. ``adapters``: LoRA's at rest (``lora.pairs``);
        ``ready``: the float8 weights of ``fp8_stack``, or None."""
        cfg, dt = self.cfg, self.cfg.compute_jnp_dtype
        post = None if post_norm is None else norm_scale(post_norm.scale.get_value(), cfg)
        return tiled_swiglu(x_BSD, *self._at_rest(dt), mesh=self.mesh, chunk=cfg.mlp_chunk,
                            over_data=cfg.shard_params_over_data, activation=mlp_activation(cfg),
                            norm=(norm_scale(norm.scale.get_value(), cfg), cfg.rms_eps), post_norm=post,
                            fp8_on=cfg.fp8, history=fp8.value(self), ready=ready, **self._lora(adapters, drop))

    def _at_rest(self, dt) -> tuple:
        """gate, up and down at rest for ``tiled_swiglu``: in ``dt``, or float8 (``fp8.Quantized``) where LoRA's base
        is stored so (``fp8_base``)."""
        if fp8_base.frozen(self, ATTRS[0]):
            return tuple(fp8_base.at_rest(self, a, dt) for a in ATTRS)
        return tuple(getattr(self, a).get_value().astype(dt) for a in ATTRS)

    def _lora(self, adapters, drop) -> dict:
        """``tiled_swiglu``'s LoRA arguments: none without LoRA (every weight trains)."""
        if self.cfg.lora is None:
            return {}
        return dict(adapters=adapters or {}, lora_cfg=self.cfg.lora, drop=drop)

    def __call__(self, x_BSD, adapters=None, drop=None, ready=None):
        """``swiglu`` (tiled with ``mlp_chunk``); ``ready``: the float8 weights of ``fp8_stack``, or None."""
        cfg, mesh, dt = self.cfg, self.mesh, self.cfg.compute_jnp_dtype
        if cfg.mlp_chunk:
            return tiled_swiglu(x_BSD, *self._at_rest(dt), mesh=mesh, chunk=cfg.mlp_chunk,
                                over_data=cfg.shard_params_over_data, activation=mlp_activation(cfg),
                                fp8_on=cfg.fp8, history=fp8.value(self), ready=ready, **self._lora(adapters, drop))
        if fp8_base.frozen(self, ATTRS[0]):  # LoRA's base in float8 at rest: gathered as it is
            ws, gathers = tuple(fp8_base.gathered(self, a, mesh, dt) for a in ATTRS), None
        else:
            ws, gathers = zip(*(use_parts(getattr(self, a), mesh, dt) for a in ATTRS))
            ws = tuple(fp8.carried(w, ready, a) for w, a in zip(ws, ATTRS))
        return constrain(swiglu(x_BSD, *ws, act=mlp_activation(cfg), adapters=adapters, lora_cfg=cfg.lora, drop=drop,
                                fp8_on=cfg.fp8, history=fp8.value(self), gathers=gathers), mesh,
                         ("batch", "seq", "embed"))
