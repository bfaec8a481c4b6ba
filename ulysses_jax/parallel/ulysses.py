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

Ulysses x ring. On a mesh whose ``ring_axis`` has ``R > 1`` devices the sequence is split over
``(ring_axis, axis_name)`` jointly, ring-major: the all-to-alls above run inside each ``sp`` group (one
node), giving each device ``S/R`` tokens of its heads, and ring attention (``ring.py``) runs across the
``R`` groups: ``R - 1`` collective-permutes of the local ``[K; V]`` per forward. The ring needs its tokens
in the zigzag order (causal load balance): ``ulysses_attention`` permutes global inputs once and restores
the order of the output, unless ``permuted=True`` says they already are in ``ring_token_order(S, R)`` (what
the model does: it permutes tokens, positions, segment ids and labels once at its input). Ring size 1 is
the plain Ulysses path, unchanged.

Attention sinks (``sinks [H]``, ``kernels/sinks.py``) enter replicated; after the exchange each device uses its own
query heads' (``exchange.local_sinks``), and their gradient sums over devices by ``shard_map``'s transpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.attention import attention, check_qkv, device_platform, resolve_impl
from ulysses_jax.kernels.segments import check_segment_ids, padding_apart
from ulysses_jax.kernels.sinks import check_sinks
from ulysses_jax.kernels.window import check_window
from ulysses_jax.parallel.exchange import heads_to_seq, local_sinks, seq_to_heads
from ulysses_jax.parallel.head_layout import plan_heads
from ulysses_jax.parallel.kept import kept_attention
from ulysses_jax.parallel.ring import (
    PALLAS_INTERPRET_KERNEL,
    PALLAS_KERNEL,
    ring_kernel,
    sequence_order,
    ulysses_ring_local,
)


def batch_axes(mesh: Mesh, *seq_axes: str) -> tuple[str, ...]:
    """The mesh axes, other than the sequence axes, that split the batch (the non-trivial ones)."""
    return tuple(a for a in mesh.axis_names if a not in seq_axes and mesh.shape[a] > 1)


def ring_size(mesh: Mesh, ring_axis: str | None) -> int:
    """Devices on ``ring_axis`` (1 when it is ``None`` or not an axis of the mesh)."""
    return mesh.shape[ring_axis] if ring_axis is not None and ring_axis in mesh.axis_names else 1


def ring_token_order(seq_len: int, ring: int) -> np.ndarray | None:
    """The token permutation (``x[:, perm]``) the ring needs (zigzag), ``None`` without a ring (``ring == 1``)."""
    return None if ring == 1 else sequence_order("zigzag", seq_len, ring)


def check_ulysses(q, k, v, segment_ids, mesh: Mesh, axis_name: str,
                  ring_axis: str | None = None) -> tuple[tuple[str, ...], int]:
    check_qkv(q, k, v, segment_ids)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    sp, ring = mesh.shape[axis_name], ring_size(mesh, ring_axis)
    b, s = q.shape[:2]
    if ring == 1 and s % sp:
        raise ValueError(
            f"sequence length ({s}) must be divisible by {axis_name} ({sp}); pad the sequence to a multiple of {sp}"
        )
    unit = math.lcm(ring * sp, 2 * ring)
    if ring > 1 and s % unit:
        raise ValueError(
            f"sequence length ({s}) must be divisible by {ring_axis} x {axis_name} ({ring} x {sp}) and by "
            f"2 x {ring_axis} ({2 * ring}, the zigzag order); pad the sequence to a multiple of {unit}"
        )
    axes = batch_axes(mesh, axis_name, *([ring_axis] if ring > 1 else []))
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
    ring_axis: str = "ring",
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
    permuted: bool = False,
    window: int | None = None,
    max_documents: int | None = None,
    keep: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention on global ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` with the sequence split over ``axis_name``
    (and ``ring_axis`` when the mesh has it with more than one device: Ulysses x ring, see the module doc).

    Same contract as ``ulysses_jax.kernels.attention`` (``max_documents``: cuDNN's bound on documents per row;
    ``keep``: the local attention is ``parallel/kept.py``'s, its output and log-sum-exp kept for the backward under a
    remat policy that saves them; not with a ring; ``window``: a causal sliding window; each device holds the
    whole sequence of its heads, so nothing else changes; with a ring, ring steps outside it are skipped). The batch
    is split over the mesh's other non-trivial axes. Inputs may come in any sharding; the output is ``[B, S, H, D]``
    sharded as ``P(batch_axes, axis_name)`` (``P(batch_axes, (ring_axis, axis_name))`` with a ring). With a ring,
    ``impl`` picks the local kernel of each ring step (``"xla"``, ``"blockwise"``, ``"pallas"``; ``"auto"``: pallas
    on GPUs, blockwise elsewhere), and
    ``permuted=True`` means inputs (and the output) are in ``ring_token_order(S, R)``. ``sinks``: ``[H]``
    attention-sink logits (gpt-oss; every impl but cuDNN), replicated on the mesh. Raises ``ValueError``
    for a sequence length not divisible by the axis sizes, a batch not divisible by the batch axes, or
    shapes that do not fit.
    """
    axes, sp = check_ulysses(q, k, v, segment_ids, mesh, axis_name, ring_axis)
    window = check_window(window, causal=causal)
    b, s, h, d = q.shape
    sinks = check_sinks(sinks, h)
    ring = ring_size(mesh, ring_axis)
    if not permuted:  # rows in token order: refused as attention() refuses them (the kernels see traced ids)
        check_segment_ids(segment_ids)
        if not causal and segment_ids is not None and ring > 1:  # the ring's chunks cannot tell padding apart
            segment_ids = padding_apart(segment_ids)
    if ring > 1:
        if keep:
            raise ValueError("keep=True (attn_keep) is for Ulysses alone: with a ring, each ring step's partial "
                             "attention has its own backward; use a mesh with ring 1")
        return _ulysses_ring(q, k, v, segment_ids, mesh=mesh, axes=axes, sp_axis=axis_name, ring_axis=ring_axis,
                             causal=causal, scale=scale, impl=impl, permuted=permuted, window=window, sinks=sinks)
    platform = device_platform(mesh)  # what the program is built for, not the machine it is traced on
    impl = resolve_impl(impl, dtype=q.dtype, head_dim=d, has_segment_ids=segment_ids is not None, platform=platform,
                        sinks=sinks is not None)
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
    if sinks is not None:
        args.append(_place(sinks, NamedSharding(mesh, P())))
        in_specs.append(P())

    def local(q, k, v, *rest):
        seg = rest[0] if segment_ids is not None else None
        sink = None if sinks is None else local_sinks(rest[-1], layout, axis_name)  # [hq]: this device's heads
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
        if keep:  # output and log-sum-exp named for the remat policy: the backward runs the kernel's backward only
            o = kept_attention(ql, kl_, vl, seg, causal=causal, scale=scale, impl=impl, platform=platform,
                               window=window, max_documents=max_documents, sinks=sink)
        else:
            o = attention(ql, kl_, vl, causal=causal, segment_ids=seg, scale=scale, impl=impl, platform=platform,
                          window=window, max_documents=max_documents, sinks=sink)
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


def _ulysses_ring(q, k, v, segment_ids, *, mesh: Mesh, axes, sp_axis: str, ring_axis: str, causal: bool, scale,
                  impl: str, permuted: bool, window: int | None = None, sinks=None) -> jax.Array:
    """The ``ring > 1`` branch of :func:`ulysses_attention`: one ``shard_map`` over ``(ring_axis, sp_axis)``."""
    s, h, d = q.shape[1:]
    kernel = ring_kernel(impl, device_platform(mesh))
    layout = plan_heads(h, k.shape[2], mesh.shape[sp_axis])
    perm = None if permuted else ring_token_order(s, mesh.shape[ring_axis])
    if perm is not None:  # once at the input; the output goes back at the end
        q, k, v = (x[:, perm] for x in (q, k, v))
        segment_ids = None if segment_ids is None else segment_ids[:, perm]
    spec = P(axes or None, (ring_axis, sp_axis), None, None)
    seg_spec = P(axes or None, (ring_axis, sp_axis))
    args = [_place(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    in_specs = [spec, spec, spec]
    if segment_ids is not None:
        args.append(_place(segment_ids, NamedSharding(mesh, seg_spec)))
        in_specs.append(seg_spec)
    if sinks is not None:
        args.append(_place(sinks, NamedSharding(mesh, P())))
        in_specs.append(P())
    ring_local = functools.partial(ulysses_ring_local, sp_axis=sp_axis, ring_axis=ring_axis, layout=layout,
                                   causal=causal, scale=scale, order="zigzag", kernel=kernel, window=window)

    def local(q, k, v, *rest):
        return ring_local(q, k, v, rest[0] if segment_ids is not None else None,
                          sinks=None if sinks is None else rest[-1])
    # Pallas kernels carry no varying-manual-axes annotations (as without a ring)
    out = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=spec,
                        check_vma=kernel not in (PALLAS_KERNEL, PALLAS_INTERPRET_KERNEL))(*args)
    return out if perm is None else out[:, np.argsort(perm)]
