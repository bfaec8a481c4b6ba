"""Ulysses sequence parallelism: attention on a sequence split over a mesh axis.

Per device, with ``P`` devices on ``axis_name`` and the head layout of ``head_layout.py``
(``hq = k_loc * g`` query heads and ``k_loc`` KV heads per device after the exchange)::

    q [B, S/P, H, D]   --gather--> [B, S/P, P*hq, D]  \
    k [B, S/P, Hkv, D] --gather--> [B, S/P, P*k_loc, D] > fused [B, S/P, P*(hq+2k_loc), D]
    v [B, S/P, Hkv, D] --gather--> [B, S/P, P*k_loc, D] /
        --seq_to_heads (all-to-all #1)--> [B, S, hq+2k_loc, D] -> q, k, v for local attention
    o [B, S, hq, D] --heads_to_seq (all-to-all #2)--> [B, S/P, P*hq, D] --drop dummies--> [B, S/P, H, D]

Bytes per device per call (``b`` = local batch, ``e`` = bytes per element): all-to-all #1's
buffer is ``b * S/P * P * (hq + 2*k_loc) * D * e`` and #2's is ``b * S/P * P * hq * D * e``; each
device keeps ``1/P`` of each buffer and sends the other ``(P-1)/P``. With ``H`` and ``Hkv`` divisible
by ``P`` this is ``b*S/P*(H + 2*Hkv)*D*e`` for Q, K, V and ``b*S/P*H*D*e`` for O, the DeepSpeed-Ulysses
volume. ``exchange_bytes`` computes it; the tests check it against the compiled HLO.

Segment ids (``[B, S/P]`` per device) are all-gathered to ``[B, S]``: every device needs the ids of
the whole sequence, which is ``4 * b * S`` bytes, small next to Q, K and V.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.attention import attention, check_qkv, device_platform, resolve_impl
from ulysses_jax.head_layout import HeadLayout, plan_heads


def seq_to_heads(x: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S/P, H, D] -> [B, S, H/P, D]``: one all-to-all; needs ``H % P == 0``."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S, H/P, D] -> [B, S/P, H, D]``: one all-to-all, the inverse of ``seq_to_heads``."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def exchange_bytes(layout: HeadLayout, *, batch: int, seq_len: int, head_dim: int, itemsize: int) -> dict[str, int]:
    """Per-device buffer bytes of the two all-to-alls (``batch`` = per-device batch, ``seq_len`` = global S)."""
    tokens = batch * (seq_len // layout.sp)
    qkv_heads = layout.padded_heads + 2 * layout.kv_heads_sent
    return {
        "qkv": tokens * qkv_heads * head_dim * itemsize,
        "out": tokens * layout.padded_heads * head_dim * itemsize,
        "sent_fraction_num": layout.sp - 1,
        "sent_fraction_den": layout.sp,
    }


def batch_axes(mesh: Mesh, axis_name: str) -> tuple[str, ...]:
    """The mesh axes, other than the sequence axis, that split the batch (the non-trivial ones)."""
    return tuple(a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1)


def check_ulysses(q, k, v, segment_ids, mesh: Mesh, axis_name: str) -> tuple[tuple[str, ...], int]:
    check_qkv(q, k, v, segment_ids)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    sp = mesh.shape[axis_name]
    b, s = q.shape[:2]
    if s % sp:
        raise ValueError(
            f"sequence length ({s}) must be divisible by {axis_name} ({sp}); pad the sequence to a multiple of {sp}"
        )
    axes = batch_axes(mesh, axis_name)
    n = math.prod(mesh.shape[a] for a in axes)
    if b % n:
        raise ValueError(
            f"batch ({b}) must be divisible by the product of the batch mesh axes "
            f"{' x '.join(f'{a}={mesh.shape[a]}' for a in axes)} = {n}"
        )
    return axes, sp


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str = "sp",
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Attention on global ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` with the sequence split over ``axis_name``.

    Same contract as ``ulysses_jax.attention``. The batch is split over the mesh's other
    non-trivial axes. Inputs may come in any sharding; the output is ``[B, S, H, D]`` sharded
    as ``P(batch_axes, axis_name)``. Raises ``ValueError`` for a sequence length not divisible by
    the axis size, a batch not divisible by the batch axes, or shapes that do not fit.
    """
    axes, sp = check_ulysses(q, k, v, segment_ids, mesh, axis_name)
    b, s, h, d = q.shape
    platform = device_platform(mesh)  # what the program is built for, not the machine it is traced on
    impl = resolve_impl(impl, dtype=q.dtype, head_dim=d, has_segment_ids=segment_ids is not None, platform=platform)
    layout = plan_heads(h, k.shape[2], sp)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    spec = P(axes or None, axis_name, None, None)
    seg_spec = P(axes or None, axis_name)
    q, k, v = (_place(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    args = [q, k, v]
    in_specs = [spec, spec, spec]
    if segment_ids is not None:
        args.append(_place(segment_ids, NamedSharding(mesh, seg_spec)))
        in_specs.append(seg_spec)

    def local(q, k, v, seg=None):
        hq, kl = layout.heads_per_device, layout.kv_per_device
        bl, sl = q.shape[:2]
        parts = [
            layout.gather_q(q).reshape(bl, sl, sp, hq, d),
            layout.gather_kv(k).reshape(bl, sl, sp, kl, d),
            layout.gather_kv(v).reshape(bl, sl, sp, kl, d),
        ]
        qkv = jnp.concatenate(parts, axis=3).reshape(bl, sl, sp * (hq + 2 * kl), d)
        qkv = seq_to_heads(qkv, axis_name)  # [b, S, hq + 2*kl, D]
        ql, kl_, vl = jnp.split(qkv, [hq, hq + kl], axis=2)
        if seg is not None:
            seg = jax.lax.all_gather(seg, axis_name, axis=1, tiled=True)  # [b, S]
        o = attention(ql, kl_, vl, causal=causal, segment_ids=seg, scale=scale, impl=impl, platform=platform)
        o = heads_to_seq(o, axis_name)  # [b, S/P, P*hq, D]
        return layout.ungather_out(o)

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=spec,
        # Kernels (Pallas, cuDNN custom calls) carry no varying-manual-axes annotations.
        check_vma=impl in ("xla", "blockwise"),
    )
    return fn(*args)
