"""The dense MLP sublayer: SwiGLU (GeGLU for Gemma 3), plain or tiled over chunks of each device's local sequence.

``mlp_chunk`` (``ModelConfig``) runs the sublayer (norm, MLP, residual add) over sequence chunks of each device's local
sequence inside ``shard_map`` (so chunking never moves activations between devices), each chunk rematerialised
(``chunked.chunk_map``). The sparse MLP (mixture of experts) is ``moe.py``.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.model.chunked import chunk_map
from ulysses_jax.model.config import local_chunks
from ulysses_jax.model.layers import ParamMaker, RMSNorm, mlp_activation, norm_scale, rms_norm, use
from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ
from ulysses_jax.parallel.sharding import constrain, fsdp_axes, gather_param


def swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD, act=jax.nn.silu):
    """The gated MLP: SwiGLU with ``act = silu``, GeGLU with a GELU (Gemma 3)."""
    h_BSF = act(x_BSD @ w_gate_DF) * (x_BSD @ w_up_DF)
    return h_BSF @ w_down_FD


def tiled_swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD, *, mesh: Mesh, chunk: int, over_data: bool,
                 norm: tuple[jax.Array, float] | None = None, post_norm: jax.Array | None = None,
                 activation=jax.nn.silu):
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
    """
    if post_norm is not None and norm is None:
        raise ValueError("post_norm tiles the whole sublayer x + post_norm(mlp(norm(x))); pass norm too")
    wa = fsdp_axes(over_data)
    act = P((DATA, FSDP), SEQ, None)

    scales = ([norm[0]] if norm else []) + ([post_norm] if post_norm is not None else [])  # at rest

    def sublayer(xc, ws):  # one chunk: x + [post_norm](mlp(norm(x)))
        y = swiglu(rms_norm(xc, ws[3], norm[1]), *ws[:3], act=activation)
        return xc + (rms_norm(y, ws[4], norm[1]) if post_norm is not None else y)

    def local(x_bsD, wg, wu, wd, *scale):
        wg, wu = (gather_param(w, 0, over_data=over_data) for w in (wg, wu))
        wd = gather_param(wd, 1, over_data=over_data)
        n = local_chunks(chunk, x_bsD.shape[1], "mlp_chunk")
        if scale:
            gs = tuple(gather_param(g, 0, over_data=over_data) for g in scale)
            return chunk_map(sublayer, n, x_bsD, (wg, wu, wd, *gs))
        return chunk_map(lambda xc, ws: swiglu(xc, *ws, act=activation), n, x_bsD, (wg, wu, wd))

    specs = (act, P(wa, None), P(wa, None), P(None, wa), *[P(wa)] * len(scales))
    # chunk_map's backward carries no varying-manual-axes types
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=act, check_vma=False)
    return fn(x_BSD, w_gate_DF, w_up_DF, w_down_FD, *scales)


class MLP(nnx.Module):
    def __init__(self, make: ParamMaker):
        self.cfg, self.mesh = make.cfg, make.mesh
        d, f = self.cfg.hidden, self.cfg.mlp_dim
        self.w_gate_DF = make("mlp.w_gate", (d, f), ("embed", "mlp"))
        self.w_up_DF = make("mlp.w_up", (d, f), ("embed", "mlp"))
        self.w_down_FD = make("mlp.w_down", (f, d), ("mlp", "embed"))

    def residual_tiled(self, x_BSD, norm: RMSNorm, post_norm: RMSNorm | None = None):
        """``x + mlp(norm(x))`` per chunk of ``mlp_chunk`` tokens (``tiled_swiglu`` with ``norm``); with
        ``post_norm`` (Gemma 3) ``x + post_norm(mlp(norm(x)))``."""
        cfg, dt = self.cfg, self.cfg.compute_jnp_dtype
        ws = (self.w_gate_DF.get_value(), self.w_up_DF.get_value(), self.w_down_FD.get_value())
        post = None if post_norm is None else norm_scale(post_norm.scale.get_value(), cfg)
        return tiled_swiglu(x_BSD, *(w.astype(dt) for w in ws), mesh=self.mesh, chunk=cfg.mlp_chunk,
                            over_data=cfg.shard_params_over_data, activation=mlp_activation(cfg),
                            norm=(norm_scale(norm.scale.get_value(), cfg), cfg.rms_eps), post_norm=post)

    def __call__(self, x_BSD):
        cfg, mesh, dt = self.cfg, self.mesh, self.cfg.compute_jnp_dtype
        if cfg.mlp_chunk:
            ws = (self.w_gate_DF.get_value(), self.w_up_DF.get_value(), self.w_down_FD.get_value())
            return tiled_swiglu(x_BSD, *(w.astype(dt) for w in ws), mesh=mesh, chunk=cfg.mlp_chunk,
                                over_data=cfg.shard_params_over_data, activation=mlp_activation(cfg))
        ws = (use(self.w_gate_DF, mesh, dt), use(self.w_up_DF, mesh, dt), use(self.w_down_FD, mesh, dt))
        return constrain(swiglu(x_BSD, *ws, act=mlp_activation(cfg)), mesh, ("batch", "seq", "embed"))
