"""The ring's entry points to the Pallas flash-attention kernels: one (query block, key block) pair of ring attention.

``pair_forward`` returns the pair's normalised output and its log-sum-exp in natural log (float32 by default, the
ring's partial results); ``pair_backward`` takes the *global* log-sum-exp and ``delta`` and returns the pair's
gradients. Both pad to the kernels' tiles and call the same kernels as ``flash_attention`` (``flash_attention.py``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ulysses_jax.kernels.flash_attention import LOG2_E, Config, backward_dkv, backward_dq, forward
from ulysses_jax.kernels.flash_blocks import (
    MIN_BLOCK,
    check_shared_memory,
    default_block_sizes,
    fit_blocks,
    next_pow2,
)


def _pair_config(q, k, *, causal: bool, scale: float, interpret: bool | None, segment_ids: bool,
                 float32: bool = True, window: int | None = None, offset: int = 0) -> Config:
    """The kernels' config for a ring pair: equal query and KV lengths, float32 outputs unless ``float32=False``."""
    b, s, h, d = q.shape
    if k.shape[1] != s:
        raise ValueError(f"a ring pair needs equal query and KV block lengths; got {q.shape=}, {k.shape=}")
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    blocks = fit_blocks(default_block_sizes(d, q.dtype), s)
    multiple = max(getattr(blocks, f.name) for f in dataclasses.fields(blocks) if f.name.startswith("block_"))
    if not interpret:
        check_shared_memory(blocks, d, q.dtype, segment_ids)
    return Config(causal=bool(causal), scale=float(scale), seq_len=s, padded_len=pl.cdiv(s, multiple) * multiple,
                   group=h // k.shape[2], blocks=blocks, interpret=bool(interpret), float32_out=bool(float32),
                   window=window, offset=int(offset))


def _pair_pad(cfg: Config, head_dim: int):
    """Pads ``[B, S, heads, D]`` to ``[B, S_pad, heads, D_pad]`` and ``[B, S]`` segment ids to ``[B, S_pad]``."""
    s, s_pad, d_pad = cfg.seq_len, cfg.padded_len, max(MIN_BLOCK, next_pow2(head_dim))

    def pad(x):
        return x if (s_pad, d_pad) == (s, head_dim) else jnp.pad(
            x, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - head_dim)))

    def pad_ids(x):  # -1 on padded rows; padded keys are masked by the length anyway
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, s_pad - s)), constant_values=-1)

    return pad, pad_ids


def pair_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool, scale: float, interpret: bool | None = None,
                 float32: bool = True, window: int | None = None, offset: int = 0, sinks=None):
    """One ring pair: ``o [b, s, H, D]`` float32 (``float32=False``: in q's dtype), normalised (0 for a row that sees
    no key), and ``lse [b, H, s]`` float32 in natural log (``-inf`` there). ``causal`` is the aligned mask: query and
    key positions coincide (``ring.py`` asks for it only then, or, with a ``window``, where they differ by the static
    ``offset``), so the positions themselves are not read. ``sinks [H]``: in the softmax, ``o`` and ``lse`` alike."""
    del q_pos, k_pos
    b, s, h, d = q.shape
    cfg = _pair_config(q, k, causal=causal, scale=scale, interpret=interpret, segment_ids=q_seg is not None,
                       float32=float32, window=window, offset=offset)
    pad, pad_ids = _pair_pad(cfg, d)
    seg = None if q_seg is None else (pad_ids(q_seg), pad_ids(k_seg))
    o, lse2 = forward(pad(q), pad(k), pad(v), seg, cfg, sinks)
    lse = jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * math.log(2.0))  # base 2 -> natural; empty rows -> -inf
    return o[:, :s, :, :d], lse[:, :, :s]


def pair_backward(q, k, v, q_pos, k_pos, q_seg, k_seg, do, lse, delta, *, causal: bool, scale: float,
                  interpret: bool | None = None, float32: bool = True, window: int | None = None, offset: int = 0):
    """Gradients of one ring pair given the *global* ``lse`` (natural log, ``-inf`` for a row that sees no key
    anywhere) and ``delta = rowsum(dO * O)``, both ``[b, H, s]`` float32: float32 ``dq``, ``dk``, ``dv``
    (``float32=False``: in the inputs' dtypes)."""
    del q_pos, k_pos
    b, s, h, d = q.shape
    cfg = _pair_config(q, k, causal=causal, scale=scale, interpret=interpret, segment_ids=q_seg is not None,
                       float32=float32, window=window, offset=offset)
    pad, pad_ids = _pair_pad(cfg, d)
    seg = None if q_seg is None else (pad_ids(q_seg), pad_ids(k_seg))
    rows = ((0, 0), (0, 0), (0, cfg.padded_len - s))
    # the kernels' L is base 2 with +inf for an empty row (exp2(x - inf) = 0); padded rows are empty too
    lse2 = jnp.pad(jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2_E), rows, constant_values=jnp.inf)
    delta = jnp.pad(delta.astype(jnp.float32), rows)
    q, k, v, do = pad(q), pad(k), pad(v), pad(do.astype(q.dtype))
    dk, dv = backward_dkv(q, k, v, seg, do, lse2, delta, cfg)
    dq = backward_dq(q, k, v, seg, do, lse2, delta, cfg)
    return dq[:, :s, :, :d], dk[:, :s, :, :d], dv[:, :s, :, :d]
