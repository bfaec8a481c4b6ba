"""LoRA's frozen base in float8 where it rests (``--fp8`` with ``--lora-rank``): quantised once, read as it is.

With adapters the seven projection weights of every layer (q, k, v, o, gate, up, down) never change, so their float8
form does not either: ``freeze`` quantises each once, when the model is made (``Transformer``, ``lora.adapted``), with
the scale the per-step path would take (``amax / 448`` of each layer's weight: ``fp8._role``), and stores it as the
parameter (``Frozen``, float8 e4m3, one byte an element) beside its per-layer amax (``<name>_amax``, float32 ``[L]``)
and a second copy laid out with the output dimensions first (``<name>_T``). The step then casts no weight, takes no
amax of one and transposes none: each projection's forward GEMM reads ``<name>_T`` and its input gradient's GEMM reads
``<name>`` (``fp8.Quantized.qt`` and ``.q``).

Why two copies. Hopper's float8 GEMMs read both operands with the contracted dimension contiguous (cuBLASLt's "TN"
only). The forward contracts a weight ``[in, out]`` over ``in``, the input gradient over ``out``, so one of the two
needs the weight transposed. XLA makes that transpose where the weight enters the layer loop, for the whole stack at
once: before this module, with the per-step quantisation, that was a transposed **bf16** copy of every stacked
projection weight per step (Llama-3.1-8B: 13 GiB of copies, +9.7 GiB at the peak, the 9.4 GiB more that ``--fp8`` held
than bf16 on the H100 in the peer benchmark); with one float8 copy at rest it would be a transposed float8 copy of
each stack per step. Two copies at rest take the bf16 base's bytes and leave the step nothing to copy.

The values are those of the per-step path bit for bit, with either recipe: a frozen weight's amax is the same every
step, so the delayed recipe's history of it holds that amax (or nothing yet) and gives the same scale as ``current``.
A consumer that needs the weight itself (the tiled attention sublayer, ``export --merge`` from the run's own base)
reads it dequantised (``plain``: ``q * scale``, the values every step computed with). A hybrid's delta-net weights
too: q, k, v and z with one amax per layer (``SHARED``: they run as one GEMM), the output projection alone; its b
and a (a few columns, into the gates) stay as they are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.model import fp8
from ulysses_jax.model.layers import use_parts
from ulysses_jax.parallel.sharding import axes_size, fsdp_axes, param_spec

# module -> (weight, number of leading "in" dimensions after the layers axis)
WEIGHTS = {"attn": (("wq_DNH", 1), ("wk_DKH", 1), ("wv_DKH", 1), ("wo_NHD", 2)),
           "mlp": (("w_gate_DF", 1), ("w_up_DF", 1), ("w_down_FD", 1)),
           "delta": (("wq_DJQ", 1), ("wk_DJQ", 1), ("wv_DUW", 1), ("wz_DUW", 1), ("wo_UWD", 2))}
# weights that share one amax per layer: the delta-net's q, k, v and z run as one GEMM on their weights side by side
# (delta_net.py), which takes one scale, the largest of the four amaxes, as quantising the four side by side would
SHARED = {"delta": ("wq_DJQ", "wk_DJQ", "wv_DUW", "wz_DUW")}
T, AMAX = "_T", "_amax"  # the suffixes of a weight's transposed copy and its amaxes


class Frozen(nnx.Param):
    """A frozen projection weight in float8 (the natural and the transposed copy) or its per-layer amaxes."""


def applies(cfg) -> bool:
    """Whether ``cfg``'s base is stored in float8: ``--fp8`` with LoRA adapters."""
    return bool(cfg.fp8) and cfg.lora is not None


def output_first(ndim: int, n_in: int) -> tuple[int, ...]:
    """The axes of a stacked weight ``[L, in..., out...]`` taken as ``[L, out..., in...]``."""
    return (0, *range(1 + n_in, ndim), *range(1, 1 + n_in))


def rest_spec(shape, names, mesh: Mesh, over_data: bool) -> P:
    """Where a float8 copy rests (one layer's ``shape`` and logical ``names``): split over the FSDP axes on its
    leading dimension, so that its gather concatenates whole rows (gathered on a later dimension, XLA transposes the
    result); the parameter's own spec where that dimension does not divide."""
    axes = fsdp_axes(over_data)
    if shape[0] % axes_size(mesh, axes) == 0:
        return P(axes, *(None,) * (len(shape) - 1))
    return param_spec(names, over_data=over_data)


@functools.lru_cache(maxsize=None)
def _quantizer(order: tuple[int, ...], dtype, shardings: tuple[NamedSharding, ...]):
    """A jitted ``w [L, ...] -> (q, q transposed by order, amax [L])``: each layer quantised with its own amax, as
    ``fp8._role`` quantises the layer's weight in the compute dtype."""

    def run(w, a):
        w = w.astype(dtype)
        s = fp8.scale_of(a, fp8.E4M3).reshape(-1, *(1,) * (w.ndim - 1))
        q = fp8.quantize(w, fp8.E4M3, s)
        return q, jnp.transpose(q, order), a

    return jax.jit(run, out_shardings=shardings)


@functools.partial(jax.jit, static_argnums=1)
def _amax(w, dtype):
    """Each layer's ``max |w|`` (``[L]`` float32) of a stacked weight in ``dtype``."""
    return jnp.max(jnp.abs(w.astype(dtype)), axis=tuple(range(1, w.ndim))).astype(jnp.float32)


def freeze(block, cfg, mesh: Mesh) -> None:
    """Replace the stacked projection weights of ``block`` (a ``Block`` of a model with ``applies(cfg)``) by their
    float8 forms at rest (module doc), those of ``SHARED`` with one amax per layer. Idempotent."""
    for module_name, weights in WEIGHTS.items():
        module = getattr(block, module_name, None)
        if module is None or isinstance(getattr(module, weights[0][0]), Frozen):
            continue
        amaxes = {attr: _amax(getattr(module, attr).get_value(), cfg.compute_jnp_dtype) for attr, _ in weights}
        shared = SHARED.get(module_name, ())
        if shared:
            amaxes.update(dict.fromkeys(shared, functools.reduce(jnp.maximum, [amaxes[a] for a in shared])))
        for attr, n_in in weights:
            var = getattr(module, attr)
            names = tuple(var.get_metadata()["logical_axes"])
            order = output_first(len(names), n_in)
            all_names = (names, tuple(names[i] for i in order), ("layers",))
            shape = var.get_value().shape
            specs = [P(None, *rest_spec(tuple(shape[i] for i in o[1:]), n[1:], mesh, cfg.shard_params_over_data))
                     for o, n in zip((tuple(range(len(names))), order), all_names)] + [P(None)]
            if cfg.attn_chunk and module_name == "attn":  # the tiled sublayer takes each weight dequantised in the
                # parameter's own layout (its shard_map's): resting so, no weight is resharded each layer
                specs[0] = P(None, *param_spec(names[1:], over_data=cfg.shard_params_over_data))
            run = _quantizer(order, cfg.compute_jnp_dtype, tuple(NamedSharding(mesh, s) for s in specs))
            with nnx.use_eager_sharding(False):  # laid out by the jitted quantiser
                for suffix, value, spec, n in zip(("", T, AMAX), run(var.get_value(), amaxes[attr]), specs, all_names):
                    setattr(module, attr + suffix, Frozen(value, out_sharding=tuple(spec), logical_axes=n))


def frozen(module, attr: str) -> bool:
    """Whether ``module.attr`` is stored in float8 at rest."""
    return isinstance(getattr(module, attr), Frozen)


def at_rest(module, attr: str, dtype) -> fp8.Quantized:
    """``module.attr``'s float8 form as it rests (sharded; inside the layer scan one layer's): ``q``, ``qt`` and the
    layer's amax and scale; ``dtype``: the compute dtype its products return in."""
    a = getattr(module, attr + AMAX).get_value()
    return fp8.Quantized(getattr(module, attr).get_value(), fp8.scale_of(a, fp8.E4M3), a, dtype,
                         getattr(module, attr + T).get_value())


def gathered(module, attr: str, mesh: Mesh, dtype) -> fp8.Quantized:
    """``at_rest`` in the compute layout (the FSDP all-gathers of both copies, in float8)."""
    w = at_rest(module, attr, dtype)
    gather, gather_t = (use_parts(getattr(module, attr + s), mesh, fp8.E4M3)[1] for s in ("", T))
    return dataclasses.replace(w, q=gather(w.q), qt=gather_t(w.qt))


def dequantize(q: jax.Array, a: jax.Array, dtype) -> jax.Array:
    """``q * scale`` in ``dtype``, ``a`` the amax of each leading slice (``[L]`` for a stack, ``[]`` for a layer)."""
    s = fp8.scale_of(a, fp8.E4M3).reshape(*a.shape, *(1,) * (q.ndim - a.ndim))
    return (q.astype(jnp.float32) * s).astype(dtype)


def plain(module, attr: str, dtype) -> jax.Array:
    """``module.attr`` as an array of ``dtype`` at rest: a frozen float8 weight dequantised, any other cast."""
    value = getattr(module, attr).get_value()
    if value.dtype != fp8.E4M3:  # not frozen, or replaced by a merged weight (lora.merged)
        return value.astype(dtype)
    return dequantize(value, getattr(module, attr + AMAX).get_value(), dtype)


def thawed(state, cfg):
    """A model's parameter state (``nnx.State``, a ``Transformer`` of ``cfg``) with each frozen weight back in
    ``cfg.param_dtype`` (dequantised, as a plain ``nnx.Param``) and its copies gone: the state of the same model
    without float8 at rest. Unchanged when nothing is frozen."""
    blocks = state["blocks"]
    for module_name, weights in WEIGHTS.items():
        if module_name not in blocks:
            continue
        module = blocks[module_name]
        for attr, _ in weights:
            var = module[attr]
            if not isinstance(var, Frozen):
                continue
            a = module[attr + AMAX].get_value()
            value = jax.jit(functools.partial(dequantize, dtype=cfg.param_jnp_dtype),
                            out_shardings=var.get_value().sharding)(var.get_value(), a)
            module[attr] = nnx.Param(value, **var.get_metadata())
            del module[attr + T], module[attr + AMAX]
    return state


def describe(cfg) -> str:
    """The start-up line's words for the base's storage."""
    delta = " (and the delta-net's q, k, v, z and output projections)" if cfg.linear_layers else ""
    return (f"q, k, v, o, gate, up and down{delta} are quantised once and rest in float8, in the two layouts the "
            f"forward's and the input gradient's GEMMs read (2 bytes a weight, as bf16): the step casts and transposes "
            f"no weight")
