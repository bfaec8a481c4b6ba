"""Ulysses sequence parallelism for the gated delta-net (Qwen3.5 / Qwen3-Next linear attention): the exchange, the
short convolution and the chunked rule on whole sequences, and the way back.

Why it fits. The delta rule is a recurrence along the sequence, run per value head, each head on its own. Ulysses
turns a sequence split into a head split: after the all-to-all each device holds *every* token of a slice of the
heads, so the recurrence runs unchanged, from the first token of each document to its last, with no state passed
between devices (a sequence-split recurrence would pass each document's ``[dk, dv]`` state from device to device, in
order). Per device, with ``P`` devices on ``axis_name``, ``kl`` key heads and ``vl = Hv / P`` value heads each::

    q, k [b, S/P, Hk, dk]  v [b, S/P, Hv, dv]  a, b [b, S/P, Hv]      (the projections, sequence-split)
      --cut per destination, concatenated-->  [b, S/P, P, kl dk + kl dk + vl dv + vl + vl]
      --one all-to-all (seq_to_heads)-->      [b, S, 1, ...]          (whole sequences, this device's heads)
      --conv1d over the q, k, v channels (kernel 4, SiLU, reset at each document)
      --gates(a, b, A_log, dt_bias), gated_delta_rule-->  o [b, S, vl, dv]
      --heads_to_seq (all-to-all #2)-->       o [b, S/P, Hv, dv]

The convolution runs *after* the exchange: each device then holds whole sequences of its channels (the conv is
depthwise: one filter per channel, no mixing), so it is exact with no halo: run before the exchange, each device would
need the ``K - 1`` tokens before its slice from its neighbour, and document resets across that seam. Its weights are
stored per head (``[H, d, K]``), so each device takes its own heads' filters. Only ``q, k, v, a, b`` cross:
``z`` (the output gate) is used per token and per head by the gated norm after the way back, on the sequence side.

Bytes per device of all-to-all #1: ``b * S/P * P * (2 kl dk + vl dv + 2 vl) * e``, of #2 ``b * S/P * Hv * dv * e``
(``e``: bytes per element of the compute dtype); each device keeps ``1/P``. The segment ids are all-gathered
(``4 b S`` bytes), as for attention.

Heads and ``P``: ``Hv`` must divide by ``P``; ``Hk`` must divide by ``P`` (``kl = Hk / P``) or ``P`` by ``Hk`` (then
``kl = 1``: each key head is copied to the ``P / Hk`` devices whose value heads read it, before the exchange, as
``head_layout.py`` copies KV heads for attention). Anything else is refused in one line. A ring (``ring > 1``) is
refused: the recurrence would need its state passed around the ring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.attention import device_platform
from ulysses_jax.kernels.gated_delta import BLOCK_STATES, gated_delta_rule, gates
from ulysses_jax.kernels.short_conv import causal_conv1d
from ulysses_jax.parallel.exchange import heads_to_seq, seq_to_heads
from ulysses_jax.parallel.kept import keep_output
from ulysses_jax.parallel.ulysses import _place, batch_axes, ring_size


@dataclasses.dataclass(frozen=True)
class DeltaLayout:
    """Which delta-net heads each of ``sp`` devices computes: ``key_slots[p * kl + i]`` is device ``p``'s ``i``-th key
    head (a copy when ``Hk < sp``); value heads are contiguous, ``vl`` per device."""

    key_heads: int
    value_heads: int
    sp: int
    kl: int
    key_slots: tuple[int, ...]

    @property
    def vl(self) -> int:
        return self.value_heads // self.sp

    @property
    def copies_keys(self) -> bool:
        return self.key_slots != tuple(range(self.key_heads))


def plan_delta_heads(key_heads: int, value_heads: int, sp: int) -> DeltaLayout:
    """The layout of ``Hk`` key and ``Hv`` value heads on ``sp`` devices (module doc); ``ValueError`` otherwise."""
    hk, hv = key_heads, value_heads
    if hv % sp or (hk % sp and sp % hk):
        fits = [p for p in range(1, hv + 1) if hv % p == 0 and (hk % p == 0 or p % hk == 0)]
        raise ValueError(f"the delta-net's {hk} key and {hv} value heads (linear_num_key_heads, "
                         f"linear_num_value_heads) do not split over sp={sp}: value heads must divide by sp, and key "
                         f"heads by sp or sp by key heads; use --mesh.sp one of {', '.join(map(str, fits))}")
    if hk % sp == 0:
        return DeltaLayout(hk, hv, sp, hk // sp, tuple(range(hk)))
    return DeltaLayout(hk, hv, sp, 1, tuple(p * hk // sp for p in range(sp)))


def delta_exchange_bytes(layout: DeltaLayout, *, batch: int, seq_len: int, dk: int, dv: int,
                         itemsize: int) -> dict[str, int]:
    """Per-device buffer bytes of the delta-net's two all-to-alls (``batch``: per device; ``seq_len``: global)."""
    tokens = batch * (seq_len // layout.sp)
    per_device = 2 * layout.kl * dk + layout.vl * dv + 2 * layout.vl
    return {"qkvab": tokens * layout.sp * per_device * itemsize, "out": tokens * layout.value_heads * dv * itemsize}


@functools.partial(jax.checkpoint, static_argnums=(7, 8, 9, 10, 11, 12, 13, 14, 15),
                   policy=jax.checkpoint_policies.save_only_these_names(BLOCK_STATES))
def _conv_and_rule(qkv, w, a, b, a_log, dt_bias, seq, widths, kl, vl, dk, dv, chunk, precision, impl, interpret):
    """On one device's whole sequences: the convolution of ``qkv [b, S, c]``, the gates and the rule, ``o [b, S, vl,
    dv]``. Rematerialised but for the rule's block states: the backward runs the convolution again rather than
    keeping its output (three ``[b, S, heads, d]`` arrays, 6 GiB per device at 8M tokens under sp = 8), and the rule's
    own backward, which keeps its inputs, then finds them recomputed."""
    bl, s_full = qkv.shape[:2]
    qkv = causal_conv1d(qkv, w, seq)
    ql, kl_, vl_ = jnp.split(qkv, np.cumsum(widths)[:2], axis=2)
    g, beta = gates(a, b, a_log, dt_bias)
    return gated_delta_rule(ql.reshape(bl, s_full, kl, dk), kl_.reshape(bl, s_full, kl, dk),
                            vl_.reshape(bl, s_full, vl, dv), g, beta, segment_ids=seq, chunk=chunk,
                            precision=precision, impl=impl, interpret=interpret)


def ulysses_gated_delta(q, k, v, a, b, conv_q, conv_k, conv_v, a_log, dt_bias, *, mesh: Mesh, axis_name: str = "sp",
                        ring_axis: str = "ring", segment_ids=None, chunk: int = 64,
                        precision: str = "highest", impl: str = "xla") -> jax.Array:
    """The delta-net's token mixing on global, sequence-split arrays: ``o [B, S, Hv, dv]`` (module doc).

    ``q, k [B, S, Hk, dk]``, ``v [B, S, Hv, dv]``, ``a, b [B, S, Hv]``: the projections before the convolution;
    ``conv_q, conv_k [Hk, dk, K]``, ``conv_v [Hv, dv, K]``: its filters (``w[..., -1]`` weighs the token itself);
    ``a_log, dt_bias [Hv]``; ``segment_ids [B, S]`` or None. The batch is split over the mesh's other non-trivial
    axes, as ``ulysses_attention`` splits it; the output comes back sequence-split like the inputs. ``precision``: the
    rule's chunk products and ``impl`` its walk over chunks (``gated_delta_rule``'s: ``"xla"`` or ``"pallas"``,
    built for the mesh's devices: Triton on GPUs, interpret mode elsewhere)."""
    if ring_size(mesh, ring_axis) > 1:
        raise ValueError(f"the gated delta-net (a 'linear' layer) does not run with a ring ({ring_axis}="
                         f"{mesh.shape[ring_axis]}): its recurrence would pass state around the ring; use "
                         f"--mesh.ring 1")
    bsz, s, hk, dk = q.shape
    hv, dv = v.shape[2:]
    sp = mesh.shape[axis_name]
    if s % sp:
        raise ValueError(f"sequence length ({s}) must be divisible by {axis_name} ({sp}); pad the sequence")
    layout = plan_delta_heads(hk, hv, sp)
    interpret = device_platform(mesh) != "gpu"  # what the program is built for, not the machine tracing it
    axes = batch_axes(mesh, axis_name)
    kl, vl = layout.kl, layout.vl
    key_slots = np.asarray(layout.key_slots, np.int32)
    spec4, spec3, spec2 = P(axes or None, axis_name, None, None), P(axes or None, axis_name, None), P(axes or None,
                                                                                                        axis_name)
    args = [_place(x, NamedSharding(mesh, sp_)) for x, sp_ in ((q, spec4), (k, spec4), (v, spec4), (a, spec3),
                                                               (b, spec3))]
    args += [_place(w, NamedSharding(mesh, P())) for w in (conv_q, conv_k, conv_v, a_log, dt_bias)]
    in_specs = [spec4] * 3 + [spec3] * 2 + [P()] * 5
    if segment_ids is not None:
        args.append(_place(segment_ids, NamedSharding(mesh, spec2)))
        in_specs.append(spec2)

    def local(q, k, v, a, b, cq, ck, cv, a_log, dt_bias, *seg):
        bl, sl = q.shape[:2]
        if layout.copies_keys:  # each device's key head copied into its slot before the exchange
            q, k = (jnp.take(x, jnp.asarray(key_slots), axis=2) for x in (q, k))
        widths = [kl * dk, kl * dk, vl * dv, vl, vl]
        parts = [q.reshape(bl, sl, sp, widths[0]), k.reshape(bl, sl, sp, widths[1]), v.reshape(bl, sl, sp, widths[2]),
                 a.reshape(bl, sl, sp, vl), b.reshape(bl, sl, sp, vl)]
        x = seq_to_heads(jnp.concatenate(parts, axis=3), axis_name)[:, :, 0]  # [b, S, c]: whole sequences
        qkv, a, b = jnp.split(x, np.cumsum(widths)[[2, 3]], axis=2)
        seq = jax.lax.all_gather(seg[0], axis_name, axis=1, tiled=True) if seg else None
        p = jax.lax.axis_index(axis_name)
        keys = jax.lax.dynamic_slice_in_dim(jnp.asarray(key_slots), p * kl, kl)
        values = p * vl + jnp.arange(vl)
        k_size = cq.shape[-1]
        w = jnp.concatenate([jnp.take(cq, keys, axis=0).reshape(-1, k_size), jnp.take(ck, keys, axis=0).reshape(
            -1, k_size), jnp.take(cv, values, axis=0).reshape(-1, k_size)], axis=0)  # this device's channels' filters
        o = _conv_and_rule(qkv, w, a, b, jnp.take(a_log, values), jnp.take(dt_bias, values), seq, tuple(widths), kl,
                           vl, dk, dv, chunk, precision, impl, interpret)
        o = keep_output(o)  # --attn-keep: kept with the rule's block states, its forward not re-run by remat
        return heads_to_seq(o, axis_name)  # [b, S/P, Hv, dv]

    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=spec4, check_vma=False)
    return fn(*args)
