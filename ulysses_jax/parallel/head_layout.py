"""Which query and KV heads each sequence-parallel device receives.

After the sequence -> heads all-to-all, device ``p`` of ``P`` holds the whole sequence for a
slice of the heads. Its query heads must find their KV heads *locally*, and the local layout
must stay plain GQA (``local query head l`` reads ``local KV head l // g``) so that any attention
kernel runs unchanged. When ``H`` and ``Hkv`` both divide by ``P`` the slices are contiguous and
nothing moves. Otherwise KV heads are replicated and query heads padded, as little as possible.

The rule. Each KV head ``j`` and its ``G = H / Hkv`` query heads are cut into ``c = ceil(G / g)``
*slots* of ``g`` query heads (the last one padded with dummy heads when ``g`` does not divide
``G``); each slot carries its own copy of KV head ``j``. The ``Hkv * c`` slots are dealt out in
order, ``k_loc = ceil(Hkv * c / P)`` per device, and the last devices get empty dummy slots if
the count does not divide. Every device then computes ``k_loc * g`` query heads and holds
``k_loc`` KV heads. Among ``g = 1 .. G`` we pick the one that (1) minimises query heads per device
(attention compute, which dominates at long context), then (2) minimises KV heads per device
(KV bytes sent). Examples (H, Hkv, P -> per device):

  * 32, 8, 8   -> 4 q, 1 kv: contiguous, no copy, no padding.
  * 32, 2, 8   -> 4 q, 1 kv: each KV head sent to 4 devices (needed: every device has query heads of it).
  * 8, 1, 4    -> 2 q, 1 kv (MQA: the one KV head goes to every device).
  * 6, 3, 2    -> 3 q, 3 kv: g = 1, so no padding; g = 2 would send 2 kv but compute 4 q heads.
  * 12, 12, 8  -> 2 q, 2 kv: 16 head slots for 12 heads, 25% of attention compute wasted.
  * 12, 4, 8   -> 2 q, 1 kv: 25% wasted (each KV head split into 2 slots of 2, one padded).

Dummy heads are zeros and their outputs are dropped, so they change no result and no gradient.
The gathers below are local copies on the sequence-sharded inputs, before anything is sent.

``HeadGroups`` cuts a device's heads further, into groups that the tiled attention sublayer
(``model/tiled_attention.py``, ``ModelConfig.attn_head_chunk``) exchanges and computes one at a time: each group
keeps the rule's property, plain GQA on the device.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    num_heads: int  # H, real query heads
    num_kv_heads: int  # Hkv, real KV heads
    sp: int  # P, devices on the sequence-parallel axis
    group: int  # g, query heads per KV head on a device
    kv_per_device: int  # k_loc
    q_slots: tuple[int, ...]  # P * k_loc * g entries: the query head in each position, -1 = dummy
    kv_slots: tuple[int, ...]  # P * k_loc entries: the KV head in each position, -1 = dummy

    @property
    def heads_per_device(self) -> int:
        return self.kv_per_device * self.group

    @property
    def padded_heads(self) -> int:
        return self.sp * self.heads_per_device

    @property
    def wasted_fraction(self) -> float:
        """Share of the attention compute spent on dummy query heads."""
        return 1.0 - self.num_heads / self.padded_heads

    @property
    def kv_heads_sent(self) -> int:
        """KV heads (real copies and dummies) in the exchange, summed over devices."""
        return self.sp * self.kv_per_device

    @cached_property
    def is_identity(self) -> bool:
        return self.q_slots == tuple(range(self.num_heads)) and self.kv_slots == tuple(range(self.num_kv_heads))

    @cached_property
    def out_index(self) -> tuple[int, ...]:
        """For each real query head, its position among the padded heads."""
        where = {h: i for i, h in enumerate(self.q_slots) if h >= 0}
        return tuple(where[h] for h in range(self.num_heads))

    def gather_q(self, x: jax.Array) -> jax.Array:
        """``[B, s, H, D] -> [B, s, P * k_loc * g, D]``: query heads in slot order, dummies zero."""
        return x if self.is_identity else _take_heads(x, self.q_slots)

    def gather_kv(self, x: jax.Array) -> jax.Array:
        """``[B, s, Hkv, D] -> [B, s, P * k_loc, D]``: KV heads (copied as needed) in slot order."""
        return x if self.is_identity else _take_heads(x, self.kv_slots)

    def ungather_out(self, x: jax.Array) -> jax.Array:
        """``[B, s, P * k_loc * g, D] -> [B, s, H, D]``: drop dummy heads, restore head order."""
        return x if self.is_identity else jnp.take(x, jnp.asarray(self.out_index), axis=2)


def _take_heads(x: jax.Array, slots: tuple[int, ...]) -> jax.Array:
    idx = jnp.asarray([max(s, 0) for s in slots])
    y = jnp.take(x, idx, axis=2)
    if min(slots) < 0:
        keep = jnp.asarray([s >= 0 for s in slots], dtype=x.dtype)
        y = y * keep[None, None, :, None]
    return y


def plan_heads(num_heads: int, num_kv_heads: int, sp: int) -> HeadLayout:
    """The head layout for ``H`` query heads, ``Hkv`` KV heads on ``P`` devices (rule: module doc)."""
    h, hkv, p = num_heads, num_kv_heads, sp
    if min(h, hkv, p) < 1:
        raise ValueError(f"heads ({h}), kv heads ({hkv}) and sp ({p}) must all be positive")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv}) for MHA/GQA/MQA")
    full_group = h // hkv

    def cost(g: int) -> tuple[int, int, int]:
        k_loc = math.ceil(hkv * math.ceil(full_group / g) / p)
        return (k_loc * g, k_loc, -g)

    g = min(range(1, full_group + 1), key=cost)
    chunks = math.ceil(full_group / g)
    k_loc = math.ceil(hkv * chunks / p)
    q_slots: list[int] = []
    kv_slots: list[int] = []
    for j in range(hkv):
        for t in range(chunks):
            kv_slots.append(j)
            for i in range(g):
                r = t * g + i
                q_slots.append(j * full_group + r if r < full_group else -1)
    pad_slots = p * k_loc - len(kv_slots)
    kv_slots += [-1] * pad_slots
    q_slots += [-1] * (pad_slots * g)
    return HeadLayout(h, hkv, p, g, k_loc, tuple(q_slots), tuple(kv_slots))


@dataclasses.dataclass(frozen=True)
class HeadGroups:
    """A device's ``hq`` query heads cut into ``count`` groups of ``size`` for the tiled attention (module doc)."""

    layout: HeadLayout
    size: int

    @property
    def count(self) -> int:
        return self.layout.heads_per_device // self.size

    @property
    def kv(self) -> int:
        """KV heads per group on a device."""
        return max(1, self.size // self.layout.group)

    def q_heads(self) -> np.ndarray:
        """``[count, sp * size]``: the query head in each slot of a group's exchange (device-major), -1 = dummy."""
        sp = self.layout.sp
        slots = np.asarray(self.layout.q_slots).reshape(sp, self.count, self.size)
        return slots.transpose(1, 0, 2).reshape(self.count, sp * self.size)

    def kv_heads(self) -> np.ndarray:
        """``[count, sp * kv]``: the KV head in each slot of a group's exchange, -1 = dummy."""
        sp, k_loc = self.layout.sp, self.layout.kv_per_device
        slots = np.asarray(self.layout.kv_slots).reshape(sp, k_loc)
        first = np.arange(self.count) * self.size // self.layout.group  # each group's first local KV head
        cols = first[:, None] + np.arange(self.kv)[None, :]
        return slots[:, cols].transpose(1, 0, 2).reshape(self.count, sp * self.kv)


def head_groups(layout: HeadLayout, head_chunk: int, flag: str = "attn_head_chunk") -> HeadGroups:
    """The groups of ``head_chunk`` query heads (0: all of a device's in one); ``ValueError`` naming the choices."""
    hq, g = layout.heads_per_device, layout.group
    size = head_chunk or hq
    if hq % size or (size % g and g % size):
        valid = [d for d in range(1, hq + 1) if hq % d == 0 and (d % g == 0 or g % d == 0)]
        raise ValueError(
            f"{flag} ({head_chunk}) must divide the {hq} query heads each device computes ({layout.num_heads} heads, "
            f"{layout.num_kv_heads} KV heads over sp={layout.sp}) and be a multiple or a divisor of the {g} query "
            f"heads per KV head there; choose one of {', '.join(map(str, valid))}, or 0 for one group")
    return HeadGroups(layout, size)
