"""Float8 projections (``ModelConfig.fp8``): the GEMMs of q, k, v, o, gate, up and down in float8, per-tensor scales.

``einsum(spec, x, w, on=True)`` is ``jnp.einsum(spec, x, w)`` with a ``jax.custom_vjp``:

* forward: ``x`` and ``w`` quantised to ``float8_e4m3fn`` (max 448), one scale each, the GEMM on the float8 operands
  accumulating in float32, the product rescaled by ``s_x s_w`` in ``x``'s dtype (the GEMM writes it: ``_dot_to``);
* backward: the output gradient ``dy`` quantised to ``float8_e5m2`` (max 57344: range for gradients) and the two
  GEMMs ``dx = dy w^T`` and ``dw = x^T dy`` on float8 operands (``dy`` e5m2 against the saved e4m3 ``w`` and ``x``),
  rescaled, cast to ``x``'s and ``w``'s dtypes. The residuals are the float8 ``x`` and ``w`` (half of bf16's bytes).

A scale ``s`` maps a tensor onto the format: ``q = cast(clip(t / s, -max, max))``, ``t ~ q s``. Recipes
(``ModelConfig.fp8_recipe``): ``current`` takes ``s = amax(t) / max`` of this very tensor (its largest magnitude lands
on the format's largest value); ``delayed`` takes the largest amax of a history of the last ``HISTORY`` steps (one per
tensor role of each projection: ``x``, ``w``, ``dy``; the first step, history all zero, scales by the current amax),
and each step writes its own amaxes into the history. The history is a ``History`` variable of the model (float32
``[layers, projections, 3, HISTORY]``), returned by the backward as its "gradient" (the rolled history with this step's
amaxes first); the train step stores it instead of updating it (``train/step.py``), so it is checkpointed with the
parameters and a resumed run scales exactly as an uninterrupted one.

Overflow and NaN. Casts saturate: a value beyond the format's largest (possible with ``delayed``, when a tensor grows
past its history) is clipped to +-max, never inf (``float8_e4m3fn`` has no inf: an unclipped cast would give NaN). An
all-zero tensor takes scale 1. A NaN anywhere in a tensor makes its amax NaN, so the scale and the whole product are
NaN; an inf makes the amax inf and the product NaN: a non-finite input never yields a finite output, and the trainer's
non-finite check stops the run.

FSDP (the plain attention and MLP sublayers): each weight is quantised where it rests, its per-tensor amax a max over
the devices (a scalar all-reduce), and gathered in float8: half of bf16's bytes, and the same values as quantising after
the gather (one scale, an elementwise cast). The tiled MLP does the same once per layer (``prequantize``) and every
chunk's product takes the float8 weight as it is (no amax and cast of the whole weight per chunk, forward and
backward): a frozen weight (LoRA's base) as a ``Quantized`` (``frozen_einsum``: no weight gradient formed), a trained
one as a ``Carried``: the float8 weight beside zeros of its gathered shape (``grad_carrier``) that take its gradient
back through the gather's transpose (``carried_einsum``). The tiled attention sublayer does the same with q, k, v
and o, whose hand-written backward reads the ``Quantized`` weights and differentiates the carriers (``carry``). LoRA's
base is quantised once and stored in float8 (``fp8_base.py``): a ``Quantized`` with both layouts (``qt``), nothing
cast in the step, but for the tiled attention's: it dequantises the base (merged with the adapters where they target
it, ``lora.merged``) and quantises it again each step, as above.

Where one history serves several uses (the tiled sublayers' chunks, head groups and devices) each use writes its amaxes
and they are combined by ``max``, not summed: ``per_device`` gives each device its own copy whose gradients meet in a
max, ``chunked.sum_f32`` takes the max of a weights dict's ``HISTORY_KEY`` entry. The tiled sublayers scale each chunk
(and head group) with its own amax under ``current``: per tile, never coarser than per tensor.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.parallel.mesh import MESH_AXES

E4M3 = jnp.float8_e4m3fn  # activations and weights
E5M2 = jnp.float8_e5m2  # output gradients
RECIPES = ("current", "delayed")
HISTORY = 16  # steps of amax history per tensor (delayed)
ROLES = ("x", "w", "dy")  # the rows of one projection's history
HISTORY_KEY = "fp8"  # a weights dict's entry holding a history (chunked.sum_f32 combines it by max)
_F32 = jnp.float32


class History(nnx.Param):
    """Amax histories of float8 scaling (``delayed``): stored by the train step, never updated by the optimizer."""


def fmax(dtype) -> float:
    """The largest finite value of a float8 format: 448 (e4m3fn), 57344 (e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax(t: jax.Array) -> jax.Array:
    """``max |t|`` in float32 (NaN if ``t`` holds a NaN)."""
    return jnp.max(jnp.abs(t)).astype(_F32)


def scale_of(a: jax.Array, dtype) -> jax.Array:
    """The scale that maps amax ``a`` onto ``dtype``'s largest value; 1 for an all-zero tensor (NaN, inf propagate).
    At least float32's smallest normal: an amax below ~5e-36 over the largest value is subnormal, which GPUs and XLA's
    CPU flush to zero, and ``t / 0`` turned a finite, tiny tensor into NaN (``maximum`` keeps a NaN amax NaN)."""
    tiny = jnp.asarray(jnp.finfo(_F32).tiny, _F32)
    return jnp.where(a == 0, jnp.ones((), _F32), jnp.maximum(a / fmax(dtype), tiny))


def quantize(t: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """``t / scale`` clipped to +-max (saturating: never inf; NaN stays NaN), cast to ``dtype``."""
    m = fmax(dtype)
    return jnp.clip(t.astype(_F32) / scale, -m, m).astype(dtype)


def _grad_specs(spec: str) -> tuple[str, str]:
    """The einsum specs of ``dx = dy w^T`` and ``dw = x^T dy`` for ``spec = "x,w->y"``."""
    ins, y = spec.split("->")
    x, w = ins.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


def _dot(spec, a, b, sa, sb):
    return jnp.einsum(spec, a, b, preferred_element_type=_F32) * (sa * sb)


def _dot_to(spec, a, b, sa, sb, dtype):
    """``_dot`` in ``dtype``. Narrower than float32, the GEMM writes ``dtype`` and the product is rescaled in it (the
    scale rounded to ``dtype``: 2^-9 in bf16): XLA folds that rescale into cuBLASLt's float8 GEMM, which then writes
    ``dtype`` itself; a float32 result was written whole and cast by a pass of its own (about 46 ms of llama3.1-8b's
    LoRA step at 8K on an H200, the profile of 2026-11-28). Triton's GEMM fusions take either form whole. bfloat16
    only: the unscaled products reach 448^2 forward and 57344 x 448 backward, past float16's 65504 (its output then
    inf), so float16 and float32 take the float32 product, rescaled before the cast."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return _dot(spec, a, b, sa, sb).astype(dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=dtype) * (sa * sb).astype(dtype)


def _used(history, row: int, current: jax.Array) -> jax.Array:
    """The amax a scale is taken from: the current one (no history, an all-zero one, or a current amax that is inf or
    NaN, which must reach the product: module doc), else the history's max."""
    if history is None:
        return current
    past = jnp.max(history[row])
    return jnp.where((past > 0) & jnp.isfinite(current), past, current)


def rolled(history: jax.Array, amaxes) -> jax.Array:
    """``history [3, HISTORY]`` shifted by one step, ``amaxes`` (x, w, dy) written first."""
    return jnp.roll(history, 1, axis=-1).at[:, 0].set(jnp.stack(amaxes).astype(_F32))


def _role(t, history, row: int, dtype, amax_over=()):
    """``(t quantised to dtype, its scale, its amax)``, the amax a max over the mesh axes ``amax_over`` (a shard's)."""
    a = amax(t)
    if amax_over:
        a = jax.lax.pmax(a, amax_over)
    s = scale_of(_used(history, row, a), dtype)
    return quantize(t, dtype, s), s, a


def quantized(x, w, history=None, gather=None) -> tuple:
    """The residuals of a float8 projection: ``x`` and ``w`` in e4m3 with their scales and amaxes (module doc).
    ``gather``: ``w`` is at rest (FSDP-split), gathered here once quantised (module doc)."""
    (xq, sx, ax), (wq, sw, aw) = _role(x, history, 0, E4M3), _role(w, history, 1, E4M3)
    return xq, wq if gather is None else gather(wq), sx, sw, ax, aw, history


def backward_f32(spec, res, dy, weight_grad: bool = True, dtypes=(_F32, _F32)):
    """``(dx, dw, the history's new value or None)``, the gradients in float32 (``dtypes``: in these two, each GEMM
    writing its own, ``_dot_to``), from ``quantized``'s residuals and the output gradient ``dy`` (quantised to e5m2
    here); ``weight_grad=False``: ``dw`` is None (a frozen weight)."""
    xq, wq, sx, sw, ax, aw, history = res
    dyq, sdy, ady = _role(dy, history, 2, E5M2)
    dx_spec, dw_spec = _grad_specs(spec)
    new = None if history is None else rolled(history, (ax, aw, ady))
    dw = _dot_to(dw_spec, xq, dyq, sx, sdy, dtypes[1]) if weight_grad else None
    return _dot_to(dx_spec, dyq, wq, sdy, sw, dtypes[0]), dw, new


def grads(spec, x, w, dy, history=None):
    """``backward_f32`` of ``x``, ``w`` (for a backward written by hand: the tiled attention's output projection);
    ``w`` an array, quantised here, or a ``Quantized`` one, taken as it is."""
    res = _residuals(x, w, history) if isinstance(w, Quantized) else quantized(x, w, history)
    return backward_f32(spec, res, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, history: jax.Array | None = None, gather=None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` (``spec`` of two operands, every index of each in the other or the output) with both
    GEMMs of the backward and the forward's in float8; ``history [3, HISTORY]``: delayed scaling; ``gather``
    (``layers.Gather``): ``w`` at rest, gathered in float8 (module doc)."""
    return _fwd(spec, x, w, history, gather)[0]


def _fwd(spec, x, w, history, gather=None):
    res = quantized(x, w, history, gather)
    xq, wq, sx, sw = res[:4]
    y = _dot_to(spec, xq, wq, sx, sw, jnp.result_type(x, w))
    return y, (res, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _bwd(spec, gather, res, dy):
    res, x0, w0 = res
    return backward_f32(spec, res, dy, dtypes=(x0.dtype, w0.dtype))


fp8_einsum.defvjp(_fwd, _bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale", "amax", "qt"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A frozen weight already in e4m3 (``q``, gathered), with its ``scale`` and ``amax`` (float32 scalars) and the
    dtype it had (``prequantize``); ``qt``: the same values with the output dimensions first, when kept (LoRA's base
    at rest, ``fp8_base``): the forward's GEMM reads it, so that neither GEMM needs the weight transposed."""

    q: jax.Array
    scale: jax.Array
    amax: jax.Array
    dtype: object
    qt: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (``q``'s: inputs first)."""
        return self.q.shape


def replicated(q: Quantized) -> Quantized:
    """``q``'s ``shard_map`` spec when every device holds it whole (``fp8_stack``'s weights): each part ``P()``."""
    return Quantized(P(), P(), P(), q.dtype, None if q.qt is None else P())


def prequantize(w: jax.Array, history=None, *, axes: tuple[str, ...] = (), gather=None) -> Quantized:
    """A frozen weight's float8 form for ``frozen_einsum``: inside ``shard_map``, ``w`` is this device's at-rest shard,
    its amax a max over ``axes`` (those it is split on), quantised here and then ``gather``-ed in float8; the values
    those of quantising the whole weight (one scale). ``history``: the projection's ``[3, HISTORY]`` (delayed). Never
    differentiated: a trained weight's gradient goes through its ``grad_carrier``."""
    wq, sw, aw = _role(jax.lax.stop_gradient(w), history, 1, E4M3, axes)
    return Quantized(wq if gather is None else gather(wq), sw, aw, w.dtype)


def _output_first(spec: str) -> str:
    """``spec`` (``"x,w->y"``) with the weight's letters reordered output first (``Quantized.qt``'s layout)."""
    ins, y = spec.split("->")
    x, w = ins.split(",")
    return f"{x},{''.join(c for c in w if c not in x)}{''.join(c for c in w if c in x)}->{y}"


def _residuals(x, q: Quantized, history) -> tuple:
    """``quantized``'s residuals for a pre-quantised weight: ``x`` quantised here, ``q`` as it is."""
    xq, sx, ax = _role(x, history, 0, E4M3)
    return xq, q.q, sx, q.scale, ax, q.amax, history


def _quantized_forward(spec, x, q: Quantized, history):
    """The forward of a pre-quantised weight: ``(y, quantised's residuals)``, ``x`` quantised here (the GEMM on
    ``q.qt`` where it is kept)."""
    res = _residuals(x, q, history)
    w, spec_w = (q.q, spec) if q.qt is None else (q.qt, _output_first(spec))
    y = _dot_to(spec_w, res[0], w, res[2], q.scale, jnp.promote_types(x.dtype, q.dtype))
    return y, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def frozen_einsum(spec: str, x: jax.Array, w: Quantized, history: jax.Array | None = None) -> jax.Array:
    """``fp8_einsum`` of a frozen, pre-quantised weight: the forward GEMM and the backward's ``dx`` only (no weight
    gradient is formed: the weight is frozen); ``history`` as ``fp8_einsum``'s, its ``w`` row from ``w.amax``."""
    return _quantized_forward(spec, x, w, history)[0]


def _frozen_fwd(spec, x, w, history):
    y, (_, *res) = _quantized_forward(spec, x, w, history)
    return y, ((None, *res), jnp.zeros((), x.dtype))  # x's float8 copy is not kept: no weight gradient needs it


def _frozen_bwd(spec, res, dy):
    res, x0 = res
    dx, _, new = backward_f32(spec, res, dy, weight_grad=False, dtypes=(x0.dtype, None))
    return dx, None, new


frozen_einsum.defvjp(_frozen_fwd, _frozen_bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["carrier", "q"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Carried:
    """A trained weight in two parts (the tiled MLP's, under FSDP): its float8 form ``q`` (``prequantize``: quantised
    where it rests, gathered in float8; never differentiated) and ``carrier``, zeros of its gathered shape and compute
    dtype (``grad_carrier``) that takes its gradient, so that the gather moves float8 and the gradient still reaches
    the weight through the gather's transpose (the reduce-scatter)."""

    carrier: jax.Array
    q: Quantized


def carried(w: jax.Array, ready: dict | None, key: str):
    """``w`` (one layer's weight in the compute dtype) as a ``Carried`` with its float8 form ``ready[key]`` (quantised
    before the layer loop: ``fp8_stack``), or ``w`` itself when ``ready`` has none."""
    if ready is None or key not in ready:
        return w
    return Carried(w, ready[key])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def grad_carrier(w: jax.Array, gather) -> jax.Array:
    """Zeros shaped like ``gather(w)`` (no collective runs); its gradient is the gather's transpose of the incoming one
    (``jax.linear_transpose``: the reduce-scatter ``gather``'s autodiff would run)."""
    s = jax.eval_shape(gather, w)
    return jnp.zeros(s.shape, s.dtype)


def _carrier_fwd(w, gather):
    return grad_carrier(w, gather), w


def _carrier_bwd(gather, w, ct):
    return (jax.linear_transpose(gather, w)(ct)[0],)


grad_carrier.defvjp(_carrier_fwd, _carrier_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def carried_einsum(spec: str, x: jax.Array, carrier: jax.Array, q: Quantized, history=None) -> jax.Array:
    """``fp8_einsum`` of a ``Carried`` weight: the products on ``q``, the weight's gradient handed to ``carrier``."""
    return _quantized_forward(spec, x, q, history)[0]


def _carried_fwd(spec, x, carrier, q, history):
    y, res = _quantized_forward(spec, x, q, history)
    return y, (res, jnp.zeros((), x.dtype), jnp.zeros((), carrier.dtype))


def _carried_bwd(spec, res, dy):
    res, x0, c0 = res
    dx, dw, new = backward_f32(spec, res, dy, dtypes=(x0.dtype, c0.dtype))
    return dx, dw, None, new


carried_einsum.defvjp(_carried_fwd, _carried_bwd)


def carry(w: dict, quantized: dict) -> dict:
    """``w`` with each entry that ``quantized`` also has (its ``Quantized`` form) as a ``Carried``: ``w``'s array the
    carrier, ``quantized``'s the float8 weight."""
    return {k: Carried(v, quantized[k]) if k in quantized else v for k, v in w.items()}


def einsum(spec: str, x, w, *, on: bool, history=None, gather=None, **kw):
    """``fp8_einsum`` when ``on`` (``ModelConfig.fp8``), else ``jnp.einsum(spec, x, w, **kw)``. ``gather``
    (``layers.use_parts``): ``w`` is at rest and gathered here, in float8 when ``on``. A ``Quantized`` ``w``
    (``prequantize``, frozen): ``frozen_einsum``."""
    if isinstance(w, Quantized):
        return frozen_einsum(spec, x, w, history)
    if isinstance(w, Carried):
        return carried_einsum(spec, x, w.carrier, w.q, history)
    if on:
        return fp8_einsum(spec, x, w, history, gather)
    return jnp.einsum(spec, x, w if gather is None else gather(w), **kw)


def row(history, i: int):
    """Projection ``i``'s ``[3, HISTORY]`` of a module's ``[projections, 3, HISTORY]`` history, or None."""
    return None if history is None else history[i]


# ----------------------------------------------------------------------------------------------
# Histories in the model and the train state


def check(cfg) -> None:
    """``ValueError`` for a float8 setting the model cannot run (``ModelConfig`` calls it)."""
    if cfg.fp8_recipe not in RECIPES:
        raise ValueError(f"fp8_recipe {cfg.fp8_recipe!r} is not a float8 scaling recipe; use --fp8-recipe current "
                         f"(this step's amax, the default) or delayed (the max of a {HISTORY}-step amax history)")
    if cfg.fp8 and cfg.num_experts:
        raise ValueError(f"--fp8 runs the dense projections in float8, but {cfg.name} has experts, whose grouped "
                         f"matmul kernel takes no float8 operands; drop --fp8 for a mixture of experts")
    if cfg.fp8 and cfg.fp8_recipe == "delayed" and cfg.offload_params:
        raise ValueError("--fp8-recipe delayed keeps its amax histories with the layers' parameters, which "
                         "--offload-params moves to host memory; use --fp8-recipe current with --offload-params")


def delayed(cfg) -> bool:
    return bool(cfg.fp8) and cfg.fp8_recipe == "delayed"


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, _F32), out_shardings=sharding)


def make_history(cfg, mesh: Mesh, projections: int, layers: int | None) -> History | None:
    """A module's history variable (``[layers, projections, 3, HISTORY]``, zeros, replicated) with ``delayed``
    scaling, else None."""
    if not delayed(cfg):
        return None
    names = (*(("layers",) if layers else ()), None, None, None)
    shape = (*((layers,) if layers else ()), projections, len(ROLES), HISTORY)
    value = _zeros(shape, NamedSharding(mesh, P()))()
    return History(value, out_sharding=(None,) * len(shape), logical_axes=names)


def value(module) -> jax.Array | None:
    """A module's history (``fp8_history``) as an array, or None."""
    var = getattr(module, "fp8_history", None)
    return None if var is None else var.get_value()


def split(params):
    """``(the rest, the histories)`` of a model's parameter state; ``(params, None)`` without histories."""
    history, rest = nnx.split_state(params, History, ...)
    return (rest, history) if jax.tree.leaves(history) else (params, None)


def join(rest, history):
    """The inverse of ``split``."""
    return rest if history is None else nnx.merge_state(rest, history)


def combine(acc, new):
    """Two histories' new values (the same step's, from two micro-batches or uses) combined: the larger amax."""
    return jax.tree.map(jnp.maximum, acc, new)


# ----------------------------------------------------------------------------------------------
# One history, several devices


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fan_out(h: jax.Array, n: int) -> jax.Array:
    return jnp.broadcast_to(h, (n, *h.shape))


def _fan_out_fwd(h, n):
    return _fan_out(h, n), None


def _fan_out_bwd(n, _, g):
    return (jnp.max(g, axis=0),)


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)

DEVICE_SPEC = P(MESH_AXES)  # a per_device array inside shard_map: one copy per device


def per_device(history: jax.Array, mesh: Mesh) -> jax.Array:
    """``history`` copied once per device (``[devices, ...]``, split by ``DEVICE_SPEC``) for a ``shard_map`` that
    takes it with that spec: each device's use writes its own copy, and the gradients meet in a max (a replicated
    input's gradients would be summed over the devices)."""
    out = _fan_out(history, mesh.devices.size)
    return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, DEVICE_SPEC))


def describe(cfg) -> str:
    """The start-up line of a float8 model: what is float8, what is not."""
    how = ("current scaling (this step's amax per tensor)" if cfg.fp8_recipe == "current" else
           f"delayed scaling (the max of a {HISTORY}-step amax history per tensor, kept in the checkpoints)")
    delta = (" and the delta-net's q, k, v, z (one GEMM) and output projections (current scaling)"
             if cfg.linear_layers else "")
    return (f"float8 GEMMs for q, k, v, o, gate, up, down{delta} (forward e4m3 x e4m3, backward e5m2 gradients x "
            f"e4m3), {how}; weights quantised where they rest and gathered in float8; master weights, optimizer, "
            f"norms, attention, loss and unembedding as without --fp8")
