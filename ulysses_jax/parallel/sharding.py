"""The one table from logical axes to mesh axes, "at rest" (parameters) and "in compute" (activations).

Every array in the model names its dimensions with logical axes (``("embed", "heads", "head_dim")``).
``LOGICAL_AXES`` maps each name, once, to mesh axes in two columns:

  * at rest: how parameters (and so optimizer state) are stored between steps. Each parameter has one
    ``embed`` dimension, split over ``FSDP``: the mesh axes ``("fsdp", "ring", "sp")`` together, or
    ``("data", "fsdp", "ring", "sp")`` for full ZeRO-3 (``fsdp_axes(over_data=True)``). Every other
    dimension is whole. Parameters and optimizer state are thus split over the whole SP x DP group, as
    DeepSpeed ZeRO-3 with Ulysses does.
  * in compute: how activations live during the step: batch over ``("data", "fsdp")``, sequence over
    ``("ring", "sp")`` jointly (ring-major; ``ring`` has size 1 for plain Ulysses), everything else whole.
    Parameters in compute are whole (replicated): the difference between the two columns *is* FSDP: an
    all-gather before use, a reduce-scatter of the gradient.

Under ``AxisType.Auto`` (the project's mode) these specs are given to ``jit`` (parameters) and to
``with_sharding_constraint`` (activations); GSPMD inserts the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.parallel.mesh import DATA, FSDP, RING, SEQ, SP

FSDP_AXES = "FSDP"  # placeholder in the table: the parameter-sharding mesh axes, see fsdp_axes()

# logical axis -> (at rest, in compute); each name once.
LOGICAL_AXES: dict[str, tuple[object, object]] = {
    "batch": (None, (DATA, FSDP)),
    "seq": (None, SEQ),
    "embed": (FSDP_AXES, None),
    "vocab": (None, None),
    "heads": (None, None),
    "kv_heads": (None, None),
    "head_dim": (None, None),
    "mlp": (None, None),
    "experts": (None, None),  # a mixture's experts: whole on every device, gathered over embed like the rest
    "linear_heads": (None, None),  # the delta-net's key or value heads (model/delta_net.py)
    "linear_dim": (None, None),  # a delta-net head's dims
    "conv": (None, None),  # the taps of the delta-net's short convolution
    "layers": (None, None),  # the stacked-layers axis of the scanned block's parameters
}


def fsdp_axes(over_data: bool = False) -> tuple[str, ...]:
    """Mesh axes that split parameters: ``("fsdp", "ring", "sp")``, plus ``"data"`` in front for full ZeRO-3."""
    return (DATA, FSDP, RING, SP) if over_data else (FSDP, RING, SP)


def _resolve(entry, over_data: bool):
    if entry == FSDP_AXES:
        return fsdp_axes(over_data)
    return entry


def _spec(names: Sequence[str | None], column: int, over_data: bool) -> P:
    parts = []
    for name in names:
        if name is None:
            parts.append(None)
            continue
        if name not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXES)}")
        parts.append(_resolve(LOGICAL_AXES[name][column], over_data))
    return P(*parts)


def param_spec(names: Sequence[str | None], *, over_data: bool = False) -> P:
    """PartitionSpec of a parameter at rest, e.g. ``("embed", "mlp") -> P(("fsdp", "ring", "sp"), None)``."""
    return _spec(names, 0, over_data)


def compute_spec(names: Sequence[str | None]) -> P:
    """PartitionSpec of an activation (or a parameter in use), e.g. ``("batch", "seq", "embed")``."""
    return _spec(names, 1, False)


def axes_size(mesh: Mesh, axes) -> int:
    """Number of devices along ``axes`` (a mesh axis name, a tuple of them, or None)."""
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def check_param_shape(path: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    """Raise ``ValueError`` when a sharded dimension does not divide over its mesh axes."""
    for dim, axes in zip(shape, spec):
        n = axes_size(mesh, axes)
        if dim % n:
            raise ValueError(
                f"parameter {path} has shape {tuple(shape)}: dimension {dim} must be divisible by the "
                f"{n} devices of mesh axes {axes} that shard it; pick a mesh whose fsdp x sp (x data) divides {dim}"
            )


def constrain(x: jax.Array, mesh: Mesh, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` of an activation to its compute layout."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, compute_spec(names)))


def row_major(x_BSD: jax.Array, mesh: Mesh) -> jax.Array:
    """``x_BSD`` unchanged, pinned to the row-major layout on each device.

    Applied to each layer's input under remat: the layer's backward reads its saved input transposed
    (``[D, S]``, for the weight gradients), and left free XLA gives the whole stack of saved inputs that layout,
    a second ``[L, S/sp, D]`` copy made between the forward and backward loops. Pinned, each layer's backward
    transposes its own slice. The same for the delta-net's normed input in head groups, which XLA otherwise made
    column-major, and copied, for its weight gradients. Inside ``shard_map``: the constraint is per device and keeps
    the sharding.
    """
    spec = compute_spec(("batch", "seq", "embed"))
    fix = jax.shard_map(lambda x: with_layout_constraint(x, Layout(major_to_minor=(0, 1, 2))), mesh=mesh,
                        in_specs=spec, out_specs=spec)
    return fix(x_BSD)


def check_batch(batch: int, mesh: Mesh) -> None:
    """The batch must divide over the compute layout's batch axes (``data x fsdp``)."""
    n = axes_size(mesh, LOGICAL_AXES["batch"][1])
    if batch % n:
        raise ValueError(
            f"batch size ({batch}) must be divisible by data x fsdp = {mesh.shape[DATA]} x {mesh.shape[FSDP]} = {n}; "
            f"use a global batch that is a multiple of {n} (or a mesh with fewer data/fsdp devices)"
        )


def check_seq(seq: int, mesh: Mesh) -> None:
    """The sequence must divide over ``ring x sp``; with a ring, each ring rank's ``S / ring`` tokens must also
    split into the zigzag order's two halves."""
    ring, sp = mesh.shape.get(RING, 1), mesh.shape[SP]
    if ring == 1 and seq % sp:
        raise ValueError(
            f"sequence length ({seq}) must be divisible by sp ({sp}); pad the sequence to a multiple of {sp}"
        )
    unit = math.lcm(ring * sp, 2 * ring)
    if ring > 1 and seq % unit:
        raise ValueError(
            f"sequence length ({seq}) must be divisible by ring x sp ({ring} x {sp}) and by 2 x ring ({2 * ring}, the "
            f"zigzag order); pad the sequence to a multiple of {unit}"
        )


def param_shardings(model, mesh: Mesh):
    """``nnx.State`` of the at-rest ``NamedSharding`` of every parameter, read from the parameters' metadata.

    Works on an abstract model from ``nnx.eval_shape`` too, whose arrays carry no sharding (flax #5110):
    use it for checkpoint-restore targets and optimizer-state layouts.
    """
    from flax import nnx

    return nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)


def param_table(model) -> list[tuple[str, tuple[int, ...], str, tuple, P, P | None]]:
    """Rows ``(path, shape, dtype, logical axes, spec at rest, actual spec)`` for every parameter of ``model``.

    ``actual spec`` is read from the array (``None`` for abstract arrays without a sharding).
    """
    from flax import nnx  # local: the table itself needs no Flax

    rows = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        names = var.get_metadata().get("logical_axes")
        want = P(*var.get_metadata().get("out_sharding") or ())
        sharding = getattr(value, "sharding", None)
        actual = sharding.spec if isinstance(sharding, NamedSharding) else None
        rows.append((".".join(map(str, path)), tuple(value.shape), str(value.dtype), names, want, actual))
    return rows


def format_param_table(model) -> str:
    """A printable table of ``param_table(model)``."""
    rows = [("parameter", "shape", "dtype", "logical axes", "at rest")]
    rows += [(p, str(s), d, str(n), str(w)) for p, s, d, n, w, _ in param_table(model)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def gather_param(w: jax.Array, axis: int, *, over_data: bool = False) -> jax.Array:
    """Inside ``shard_map``: the FSDP all-gather of a parameter's at-rest shard along its ``embed`` ``axis``.

    Its transpose is the reduce-scatter of the gradient. A parameter not split over ``data`` is first
    marked as varying over ``data``, so that the gradient's sum over ``data`` runs on the reduced shard
    (after the reduce-scatter) rather than on the whole gathered gradient.
    """
    if not over_data:
        w = jax.lax.pcast(w, (DATA,), to="varying")
    return jax.lax.all_gather(w, fsdp_axes(over_data), axis=axis, tiled=True)
