"""LoRA: low-rank adapters on the attention and MLP projections, the rest of the model frozen (``ModelConfig.lora``).

Each targeted weight ``W`` (stacked ``[L, in..., out...]``, e.g. ``wq_DNH``: in ``D``, out ``N H``) gets two adapter
matrices, ``LoraParam`` variables under ``blocks.lora``: ``A [L, in..., r]`` (uniform in +-1/sqrt(in), peft's default)
and ``B [L, r, out...]`` (zeros), so the model starts as the base. They are float32 whatever the base's dtype, created
born sharded like every parameter (``A`` over the FSDP axes on its ``embed`` dimension where it has one, ``B`` on its
``embed`` dimension where it has one, whole otherwise: ``B`` of q/k/v/gate/up is ``r x out``, a few MB).

Each projection that reads a targeted weight adds the adapter's term beside the frozen weight's product (peft's
forward): ``x W + (alpha / r) dropout(x) A B`` (``low_rank``; ``x A`` accumulated in float32, ``A`` rounded to the
compute dtype, ``B`` in float32). The plain attention (q, k, v, o) and the dense MLP (plain and tiled) do so, so the
backward forms only the adapters' small gradients (``dA = x^T (dy B^T)``), never a targeted weight's full gradient, and
the frozen base's weights are differentiated nowhere (``chunked.chunk_map`` takes them as ``frozen``). Dropout
(``LoraConfig.dropout``, training only) draws each token's mask from its global index in the batch (``dropout``), so
the masks are the same on any mesh and with or without tiling; each target its own mask, as peft's separate dropout
modules.

The tiled attention sublayer (``attn_chunk``: ``tiled_attention.py``, whose backward is written by hand) instead reads
merged weights: the hook ``merged`` replaces each attention target ``W`` by ``stop_gradient(W) + scale A B`` (float32,
at rest) in that case only, and its backward forms those weights' full gradients before reducing them to ``A`` and
``B``; with a bfloat16 compute dtype the merged weight is rounded once to bfloat16. Dropout is refused there.

With ``fp8`` (``fp8.py``) the frozen base's product ``x W`` runs in float8 and the adapters' term as above; the base's
seven projection weights are stored in float8, quantised once (``fp8_base.py``); under ``attn_chunk`` the merged
weight (the dequantised base and the adapters) is what is quantised.

The train step differentiates the ``LoraParam`` variables alone (``split``), so the base has no gradient and no
optimizer state (``train/step.py``). MLP targets on a mixture of experts are refused (``LoraConfig.check``).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from ulysses_jax.model import fp8_base
from ulysses_jax.model.layers import use
from ulysses_jax.model.lora_config import (  # noqa: F401  (target_layers: for interop/peft.py)
    ALL_TARGETS,
    ATTENTION_TARGETS,
    LoraConfig,
    projection_sides,
    target_layers,
)
from ulysses_jax.parallel.sharding import check_param_shape, param_spec

# target -> (submodule of the block, weight attribute, number of leading "in" dimensions of the weight); a tuple of
# attributes: one adapter over the weights' outputs side by side, flattened (in_proj_qkv: q, k, v as Qwen3.5 fuses them)
WEIGHTS = {
    "q": ("attn", "wq_DNH", 1),
    "k": ("attn", "wk_DKH", 1),
    "v": ("attn", "wv_DKH", 1),
    "o": ("attn", "wo_NHD", 2),
    "gate": ("mlp", "w_gate_DF", 1),
    "up": ("mlp", "w_up_DF", 1),
    "down": ("mlp", "w_down_FD", 1),
    "in_proj_qkv": ("delta", ("wq_DJQ", "wk_DJQ", "wv_DUW"), 1),
    "in_proj_z": ("delta", "wz_DUW", 1),
    "in_proj_b": ("delta", "wb_DU", 1),
    "in_proj_a": ("delta", "wa_DU", 1),
    "out_proj": ("delta", "wo_UWD", 2),
}
assert tuple(WEIGHTS) == ALL_TARGETS


class LoraParam(nnx.Param):
    """An adapter matrix: the only kind of parameter that trains in a model with adapters."""


@functools.lru_cache(maxsize=None)
def _init(bound: float, shape: tuple[int, ...], sharding: NamedSharding):
    """A jitted initializer laid out as ``sharding``: uniform in ``+-bound`` (``bound`` 0: zeros), float32."""

    def init(key):
        if bound == 0:
            return jnp.zeros(shape, jnp.float32)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound)

    return jax.jit(init, out_shardings=sharding)


def weight(block, target: str) -> nnx.Param:
    """The weight ``target`` adapts (the first of a fused target's)."""
    module, attr, _ = WEIGHTS[target]
    return getattr(getattr(block, module), attr if isinstance(attr, str) else attr[0])


def _shapes(block, target: str, rank: int):
    """``((A shape, A names), (B shape, B names))`` of ``target``'s adapter on a stacked block (leading ``layers``
    axis): ``A [L, in..., r]``, ``B [L, r, out...]``; a fused target's ``B [L, r, out]`` over its weights' outputs
    flattened side by side."""
    _, attrs, n_in = WEIGHTS[target]
    w = weight(block, target)
    shape, names = tuple(w.get_value().shape), tuple(w.get_metadata()["logical_axes"])
    (l, *rest), (_, *axes) = shape, names
    a = ((l, *rest[:n_in], rank), ("layers", *axes[:n_in], None))
    if not isinstance(attrs, str):
        module = getattr(block, WEIGHTS[target][0])
        out = sum(math.prod(getattr(module, x).get_value().shape[1 + n_in:]) for x in attrs)
        return a, ((l, rank, out), ("layers", None, None))
    b = ((l, rank, *rest[n_in:]), ("layers", None, *axes[n_in:]))
    return a, b


def split_fused(term: jax.Array, shapes) -> list[jax.Array]:
    """A fused target's ``[..., out]`` (its weights' outputs side by side) cut into each weight's output ``shapes``."""
    sizes = [math.prod(s) for s in shapes]
    parts = jnp.split(term, list(itertools.accumulate(sizes))[:-1], axis=-1)
    return [x.reshape(*x.shape[:-1], *s) for x, s in zip(parts, shapes)]


class Adapters(nnx.Module):
    """The adapters of every layer of a ``Block`` (stacked), ``w_<target>_a`` and ``w_<target>_b``."""

    def __init__(self, block, lora: LoraConfig, mesh, rngs: nnx.Rngs, over_data: bool = False):
        # keys folded from the params stream's base key without drawing from it: the base's values do not change
        base_key = jax.random.fold_in(rngs.params.key.get_value(), 0x10A)
        for t in lora.targets:
            _, _, n_in = WEIGHTS[t]
            for side, (shape, names) in zip("ab", _shapes(block, t, lora.rank)):
                spec = param_spec(names, over_data=over_data)
                check_param_shape(f"lora.{t}.{side}", shape, spec, mesh)
                fan_in = math.prod(shape[1:1 + n_in])
                key = jax.random.fold_in(base_key, ALL_TARGETS.index(t))
                value = _init(fan_in ** -0.5 if side == "a" else 0.0, shape, NamedSharding(mesh, spec))(key)
                setattr(self, f"w_{t}_{side}", LoraParam(value, out_sharding=tuple(spec), logical_axes=names))


def attach(block, cfg, mesh, rngs: nnx.Rngs) -> None:
    """Give ``block`` (a stacked ``Block`` of a model whose ``cfg.lora`` is set) its adapters, ``block.lora``."""
    cfg.lora.check(cfg)
    block.lora = Adapters(block, cfg.lora, mesh, rngs, cfg.shard_params_over_data)


def adapted(model, graphdef, cfg, seed: int):
    """``model`` (a ``Transformer`` without adapters, e.g. read from a Hugging Face folder) with fresh adapters, as the
    model of ``graphdef`` (that of a ``Transformer`` of ``cfg``, whose ``lora`` is set). The adapters are those a
    ``Transformer(cfg, rngs=nnx.Rngs(seed))`` is born with; the base's arrays are reused, not copied."""
    with nnx.use_eager_sharding(False):  # values already laid out, as Transformer makes its parameters
        model.blocks.lora = Adapters(model.blocks, cfg.lora, model.mesh, nnx.Rngs(seed), cfg.shard_params_over_data)
        if fp8_base.applies(cfg):  # --fp8: the frozen projections in float8 where they rest, as Transformer has them
            fp8_base.freeze(model.blocks, cfg, model.mesh)
    return nnx.merge(graphdef, nnx.state(model))


def delta(a: jax.Array, b: jax.Array, n_in: int, scale: float) -> jax.Array:
    """``scale * A B`` in float32: ``[..., in..., r] x [..., r, out...] -> [..., in..., out...]`` (with or without the
    leading layers axis)."""
    lead = a.ndim - n_in - 1
    a2 = a.reshape(*a.shape[:lead], math.prod(a.shape[lead:-1]), a.shape[-1])
    b2 = b.reshape(*b.shape[:lead], b.shape[lead], -1)
    out = jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (scale * out).reshape(*a.shape[:-1], *b.shape[lead + 1:])


def merged_targets(cfg) -> tuple[str, ...]:
    """The targets read as merged weights (``merged``): the attention's under ``attn_chunk``, else none."""
    return tuple(t for t in cfg.lora.targets if t in ATTENTION_TARGETS) if cfg.attn_chunk else ()


def merged(block):
    """``block`` (one layer's, inside the layer scan) with each of ``merged_targets`` replaced by
    ``stop_gradient(W) + scale * A B`` (float32, at rest); unchanged without adapters. The hook of the module doc."""
    cfg = block.attn.cfg
    if cfg.lora is None:
        return block
    for t in merged_targets(cfg):
        module, attr, n_in = WEIGHTS[t]
        a, b = getattr(block.lora, f"w_{t}_a").get_value(), getattr(block.lora, f"w_{t}_b").get_value()
        base = jax.lax.stop_gradient(fp8_base.plain(getattr(block, module), attr, jnp.float32))
        weight(block, t).set_value(base + delta(a, b, n_in, cfg.lora.scale))
    return block


def pairs(block, module: str, at_rest: bool = False) -> dict:
    """``{target: (A, B)}`` of this layer's adapters on ``module``'s (``"attn"``, ``"mlp"``, ``"delta"``) weights that
    are not merged: in their compute layout (gathered, ``A`` in the compute dtype, ``B`` in float32), or ``at_rest``."""
    cfg = block.attn.cfg
    if cfg.lora is None:
        return {}
    out = {}
    for t in cfg.lora.targets:
        if WEIGHTS[t][0] != module or t in merged_targets(cfg):
            continue
        a, b = getattr(block.lora, f"w_{t}_a"), getattr(block.lora, f"w_{t}_b")
        out[t] = (a.get_value(), b.get_value()) if at_rest else (
            use(a, block.mesh, cfg.compute_jnp_dtype), use(b, block.mesh, jnp.float32))
    return out


def token_ids(shape) -> jax.Array:
    """``[B, S]`` int32: each token's index in the global batch, ``row * S + position`` (dropout's mask key)."""
    b, s = shape
    return jnp.arange(b, dtype=jnp.int32)[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None, :]


def dropout(x: jax.Array, rate: float, key: jax.Array, ids: jax.Array) -> jax.Array:
    """``x [b, s, ...]`` with each element zeroed with probability ``rate`` and the rest scaled by ``1 / (1 - rate)``;
    token ``ids [b, s]``'s mask drawn from ``fold_in(key, id)``, whatever part of the batch ``x`` is."""
    draw = lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, x.shape[2:])  # noqa: E731
    keep = jax.vmap(jax.vmap(draw))(ids)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


def low_rank(x: jax.Array, adapters: dict | None, target: str, lora: LoraConfig | None, drop=None):
    """The adapter's term of ``target``'s projection of ``x [b, s, in...]``: ``scale * dropout(x) A B``
    ``[b, s, out...]`` in ``x``'s dtype, with ``(A, B) = adapters[target]``; 0 where ``adapters`` (``pairs``) has
    none. ``drop``: ``(key, token ids [b, s])`` while training with ``lora.dropout``, else ``None``."""
    if not adapters or target not in adapters:
        return 0
    a, b = adapters[target]
    n_in = WEIGHTS[target][2]
    if drop is not None and lora.dropout:
        key, ids = drop
        x = dropout(x, lora.dropout, jax.random.fold_in(key, ALL_TARGETS.index(target)), ids)
    xa = jnp.tensordot(x, a.astype(x.dtype), axes=n_in, preferred_element_type=jnp.float32)
    return (lora.scale * _widen(xa, b.astype(jnp.float32))).astype(x.dtype)


def _full_width(xa: jax.Array, b: jax.Array) -> jax.Array:
    """``xa B``, float32: the adapter's term at full width ``[b, s, out...]`` from its rank-``r`` ``xa [b, s, r]``."""
    return jnp.tensordot(xa, b, axes=1)


# ``_full_width`` as a ``custom_vjp`` whose residuals are its inputs, so that no remat policy keeps its output:
# ``--remat save_matmuls`` keeps the output of every matmul it sees, and this one, float32 at full width beside the
# base's bf16 product, is recomputed in ``2 r`` FLOPs an element (kept, Llama-3.1-8B LoRA at 32K on one compile-only
# H200 needed 267 GiB with that policy). Its forward rule calls ``_widen`` itself: a bare dot there is one the
# policy sees, and keeps (tests/test_lora.py counts the residuals).
_widen = jax.custom_vjp(_full_width)
_widen.defvjp(lambda xa, b: (_widen(xa, b), (xa, b)), lambda res, g: jax.vjp(_full_width, *res)[1](g))


def split(params):
    """``(adapters, the rest)`` of a model's parameter state; ``(params, None)`` for a model without adapters."""
    trainable, frozen = nnx.split_state(params, LoraParam, ...)
    if not jax.tree.leaves(trainable):
        return params, None
    return trainable, frozen


def join(trainable, frozen):
    """The inverse of ``split``."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def count(cfg) -> tuple[int, int]:
    """``(adapter parameters, base parameters of the targeted weights)`` of a ``ModelConfig`` with ``lora``, over the
    layers that have each targeted module (a hybrid's other layers hold adapters that are never read)."""
    sizes, r = projection_sides(cfg), cfg.lora.rank
    layers = {t: len(target_layers(cfg, t)) for t in cfg.lora.targets}
    adapters = sum(r * (sizes[t][0] + sizes[t][1]) * layers[t] for t in cfg.lora.targets)
    base = sum(sizes[t][0] * sizes[t][1] * layers[t] for t in cfg.lora.targets)
    return adapters, base


def describe(cfg) -> str:
    """The start-up line of a model with adapters: what trains, what it costs, what is frozen."""
    from ulysses_jax.model.flops import param_count

    adapters, _ = count(cfg)
    total = param_count(cfg)
    base_gib = total * jnp.dtype(cfg.param_dtype).itemsize / 2**30
    stored = f"; with --fp8 its {fp8_base.describe(cfg)}" if fp8_base.applies(cfg) else ""
    return (f"{cfg.lora.describe()}: {adapters:,} parameters train ({100 * adapters / total:.2f}% of "
            f"{total / 1e6:,.1f}M), {adapters * 16 / 2**20:,.1f} MiB in all with their float32 gradients and AdamW "
            f"state; the base is frozen in {cfg.param_dtype} ({base_gib:.2f} GiB over the devices), with no gradient "
            f"and no optimizer state{stored}")
