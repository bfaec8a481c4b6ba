"""The device mesh: axes ``("data", "fsdp", "ring", "sp")`` with ``sp`` innermost.

Axis roles:
  * ``data``: pure replicas (gradients averaged across them).
  * ``fsdp``: splits the batch, and parameters/optimizer state (ZeRO-3 style).
  * ``ring``: ring attention (``ring.py``): the sequence is split over ``ring`` x ``sp`` jointly and K/V
              blocks travel around the ring. Between ``fsdp`` and ``sp``: a ring step crosses hosts
              (the network), while each ``sp`` group stays on one host. Size 1 (the default) is plain Ulysses.
  * ``sp``:   Ulysses sequence parallelism. Innermost (fastest varying) so that the
              devices of one ``sp`` group are neighbours in ``jax.devices()`` order,
              i.e. they share a host and its fast interconnect for the all-to-alls.

All four axes are always present (size 1 when unused). The sequence dimension of activations is split over
``SEQ = ("ring", "sp")``, ring-major.

Sharding mode: the project uses ``AxisType.Auto`` axes (GSPMD-style propagation
outside ``shard_map``); every mesh built here has them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "ring", "sp")
DATA, FSDP, RING, SP = MESH_AXES
SEQ = (RING, SP)  # the mesh axes that split the sequence, ring-major


def resolve_axis_sizes(n_devices: int, *, data: int = 1, fsdp: int = -1, ring: int = 1,
                       sp: int = 1) -> tuple[int, int, int, int]:
    """Fill in the one ``-1`` size (if any) and check the product equals ``n_devices``."""
    sizes = {"data": data, "fsdp": fsdp, "ring": ring, "sp": sp}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name}={size!r} must be a positive integer or -1 (take the remaining devices)")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {', '.join(f'{n}=-1' for n in free)}; give explicit sizes")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if n_devices % fixed:
            raise ValueError(
                f"cannot fill {free[0]}=-1: the other axes ({_fmt(sizes)}) multiply to {fixed}, "
                f"which does not divide the {n_devices} devices; choose sizes whose product divides {n_devices}"
            )
        sizes[free[0]] = n_devices // fixed
    total = math.prod(sizes.values())
    if total != n_devices:
        raise ValueError(
            f"mesh sizes {_fmt(sizes)} multiply to {total} but there are {n_devices} devices; "
            f"choose sizes whose product is {n_devices} (or set one axis to -1)"
        )
    return sizes["data"], sizes["fsdp"], sizes["ring"], sizes["sp"]


def make_mesh(*, data: int = 1, fsdp: int = -1, ring: int = 1, sp: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the ``("data", "fsdp", "ring", "sp")`` mesh over ``devices`` (default: all devices).

    ``-1`` takes the remaining devices. ``sp`` varies fastest over the device list,
    so consecutive devices (one host's GPUs) form an ``sp`` group; with ``sp`` = GPUs per host the
    ``ring`` neighbours are on consecutive hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_axis_sizes(len(devices), data=data, fsdp=fsdp, ring=ring, sp=sp)
    # Order devices by (process, id) so that an sp group never straddles hosts
    # when sp divides the per-host device count.
    devices.sort(key=lambda d: (d.process_index, d.id))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _fmt(sizes: dict[str, int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items() if name != "ring" or size != 1)
