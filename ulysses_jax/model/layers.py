"""Layer primitives shared by the transformer and its tiled sublayers: parameters born sharded, positions, RoPE and
RMSNorm.

Parameters are created already split at rest (``parallel/sharding.py``): a jitted initializer per parameter writes each
device's shard directly, so no device ever holds a whole copy, and the random values do not depend on the mesh (JAX's
partitionable threefry). ``use`` gathers a parameter into its compute layout where it is used.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ulysses_jax.model.config import ModelConfig
from ulysses_jax.parallel.sharding import check_param_shape, compute_spec, param_spec

# ----------------------------------------------------------------------------------------------
# Parameters: born sharded


@functools.lru_cache(maxsize=None)
def sharded_init(kind: str, std: float, shape: tuple[int, ...], dtype, sharding: NamedSharding):
    """A jitted initializer whose output is laid out as ``sharding`` (each device computes its shard)."""

    def init(key):
        if kind == "normal":
            return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        if kind == "log_uniform":  # the delta-net's A_log: log of A uniform in [0.01, 16], as transformers draws it
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
        return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)

    return jax.jit(init, out_shardings=sharding)


@dataclasses.dataclass(frozen=True)
class ParamMaker:
    """Creates the parameters of one module: already sharded, and stacked ``[L, ...]`` when ``stack`` is set
    (the layers of the scanned block carry a leading ``"layers"`` axis, whole on every device)."""

    cfg: ModelConfig
    mesh: Mesh
    rngs: nnx.Rngs
    stack: int | None = None

    def __call__(self, name: str, shape, names, init: str = "normal") -> nnx.Param:
        shape, names = tuple(shape), tuple(names)
        if self.stack is not None:
            shape, names = (self.stack, *shape), ("layers", *names)
        spec = param_spec(names, over_data=self.cfg.shard_params_over_data)
        check_param_shape(name, shape, spec, self.mesh)
        key = self.rngs.params()  # drawn for every parameter, so the stream does not depend on the init kind
        sharding = NamedSharding(self.mesh, spec)
        value = sharded_init(init, self.cfg.init_std, shape, self.cfg.param_jnp_dtype, sharding)(key)
        return nnx.Param(value, out_sharding=tuple(spec), logical_axes=names)


def use(param: nnx.Param, mesh: Mesh, dtype) -> jax.Array:
    """A parameter in its compute layout (whole: the FSDP all-gather), cast to ``dtype`` before the gather.

    Inside the layer scan a stacked parameter arrives as one layer's slice: its ``"layers"`` name is dropped.
    """
    value, gather = use_parts(param, mesh, dtype)
    return gather(value)


@dataclasses.dataclass(frozen=True)
class Gather:
    """``use``'s FSDP gather alone: an array shaped like the parameter constrained to its compute layout."""
    sharding: NamedSharding

    def __call__(self, t: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(t, self.sharding)


def use_parts(param: nnx.Param, mesh: Mesh, dtype) -> tuple[jax.Array, Gather]:
    """``use`` in two steps: the parameter cast to ``dtype`` in its at-rest layout, and its gather, for a caller that
    changes the weight before gathering it (float8: quantised first, so that the gather moves float8;
    ``fp8.einsum``'s ``gather``)."""
    value, names = param.get_value(), param.get_metadata()["logical_axes"]
    if len(names) == value.ndim + 1 and names[0] == "layers":
        names = names[1:]
    return value.astype(dtype), Gather(NamedSharding(mesh, compute_spec(names)))


# ----------------------------------------------------------------------------------------------
# Positions and RoPE


def document_positions(segment_ids_BS: jax.Array) -> jax.Array:
    """Position of each token within its document: restarts at 0 wherever the segment id changes."""
    s = segment_ids_BS.shape[1]
    idx_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids_BS.shape)
    start_BS = jnp.concatenate(
        [jnp.ones_like(segment_ids_BS[:, :1], bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1
    )
    return idx_BS - jax.lax.cummax(jnp.where(start_BS, idx_BS, 0), axis=1)


def default_positions(tokens_BS: jax.Array, segment_ids_BS: jax.Array | None) -> jax.Array:
    """0, 1, ... along each row, restarting at each document of ``segment_ids`` when given (natural order)."""
    if segment_ids_BS is None:
        return jnp.broadcast_to(jnp.arange(tokens_BS.shape[1], dtype=jnp.int32), tokens_BS.shape)
    return document_positions(segment_ids_BS)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies ``[R/2]`` (float64) of the ``R = cfg.rotary_dim`` rotated dims (``head_dim`` unless
    ``partial_rotary_factor``), scaled when ``cfg.rope_scaling`` is set (Llama-3 style or linear).
    ``local``: a local layer's, from ``rope_local_theta`` unscaled when that is set (Gemma 3)."""
    h = cfg.rotary_dim
    exponents = np.arange(0, h, 2, dtype=np.float64) / h
    if local and cfg.rope_local_theta:
        return 1.0 / cfg.rope_local_theta ** exponents
    inv_freq = 1.0 / cfg.rope_theta ** exponents
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc.rope_type == "linear":
        return inv_freq / sc.factor
    if sc.rope_type == "yarn":
        return _yarn_frequencies(inv_freq, cfg.rope_theta, h, sc)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = sc.original_max_position / sc.low_freq_factor
    high_freq_wavelen = sc.original_max_position / sc.high_freq_factor
    smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / sc.factor, inv_freq)  # long wavelengths: slowed
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return np.where(medium, (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq, scaled)


def _yarn_frequencies(inv_freq: np.ndarray, theta: float, dim: int, sc) -> np.ndarray:
    """YaRN (as transformers' ``_compute_yarn_parameters``): the frequencies whose wavelength fits ``beta_fast``
    rotations in the original context keep their value, those under ``beta_slow`` rotations are divided by
    ``factor``, a linear ramp over the dimensions between."""
    def correction_dim(rotations):
        return dim * math.log(sc.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    return inv_freq / sc.factor * (1 - keep) + inv_freq * keep


def rope_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (``0.1 ln(factor) + 1`` unless the config gives
    one), else 1; local layers with their own base (``rope_local_theta``) are unscaled."""
    sc = cfg.rope_scaling
    if sc is None or sc.rope_type != "yarn" or (local and cfg.rope_local_theta):
        return 1.0
    if sc.attention_factor:
        return sc.attention_factor
    return 1.0 if sc.factor <= 1 else 0.1 * math.log(sc.factor) + 1.0


def apply_rope(x_BSNH: jax.Array, positions_BS: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotate halves ``(x1, x2)`` of the head dim by ``position * inv_freq`` (computed in float32); ``factor``
    multiplies cos and sin (``rope_factor``). With fewer frequencies than half the head dim (partial RoPE: Qwen3.5,
    Qwen3-Next), the first ``2 * len(inv_freq)`` dims are rotated that way and the rest pass through unchanged."""
    angle_BSh = positions_BS[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    sin, cos = jnp.sin(angle_BSh)[:, :, None], jnp.cos(angle_BSh)[:, :, None]
    if factor != 1.0:
        sin, cos = sin * factor, cos * factor
    rotated = 2 * len(inv_freq)
    x32 = x_BSNH.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rotated], 2, axis=-1)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotated < x_BSNH.shape[-1]:
        parts.append(x32[..., rotated:])
    return jnp.concatenate(parts, axis=-1).astype(x_BSNH.dtype)


def norm_scale(scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A norm's float32 multiplier from its stored scale: ``1 + w`` when ``cfg.norm_plus_one`` (Gemma 3), else ``w``."""
    scale = scale.astype(jnp.float32)
    return 1.0 + scale if cfg.norm_plus_one else scale


def mlp_activation(cfg: ModelConfig):
    """The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (Gemma 3's GeGLU)."""
    return jax.nn.silu if cfg.mlp_activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nnx.Module):
    def __init__(self, make: ParamMaker, dim: int, names: tuple[str, ...]):
        self.cfg, self.mesh = make.cfg, make.mesh
        self.scale = make("norm.scale", (dim,), names, init="zeros" if make.cfg.norm_plus_one else "ones")

    def __call__(self, x: jax.Array, remat: bool = False) -> jax.Array:
        """``remat``: the backward recomputes the norm from ``x`` instead of keeping its float32 intermediates (each
        the size of ``x`` twice over), for a norm whose whole-sequence output feeds several products."""
        norm = jax.checkpoint(rms_norm, static_argnums=(2,)) if remat else rms_norm
        return norm(x, norm_scale(use(self.scale, self.mesh, jnp.float32), self.cfg), self.cfg.rms_eps)


# ----------------------------------------------------------------------------------------------
# The unembedding's product


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def wide_dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` with a float32 result (the logits), whose backward rounds the float32 cotangent to the
    operands' dtype before its two GEMMs: they run on bf16 operands with float32 accumulation, as the forward's does,
    and return the operands' dtype. Left to autodiff, the float32 cotangent makes each a float32 GEMM (the other
    operand converted up: TF32 on Hopper): the profile of llama3.2-1b at 32K on an H200 (2026-11-28) spent 119 ms of
    its 1,178 ms step in those GEMMs of the tiled loss (`experiments/results/gpu_h200_20261128`). bfloat16 operands
    alone (``cotangent_dtype``); float32 and float16 ones take autodiff's GEMMs."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def cotangent_dtype(*operands) -> jnp.dtype:
    """The dtype the logits' float32 cotangent is rounded to before the GEMMs of its backward (``wide_dot``, the fused
    loss): bfloat16 for bfloat16 operands, which holds float32's range, else float32. float16 would flush the small
    terms (a softmax over 128K entries, divided by the tokens of a mean) to zero."""
    dtype = jnp.result_type(*operands)
    return dtype if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _wide_dot_fwd(spec, a, b):
    return wide_dot(spec, a, b), (a, b)


def _wide_dot_bwd(spec, res, ct):
    a, b = res
    dtype = cotangent_dtype(a, b)
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=dtype), a, b)
    return vjp(ct.astype(dtype))


wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)
