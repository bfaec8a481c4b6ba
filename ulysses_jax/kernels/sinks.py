"""Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax and attends to nothing.

With ``s_j`` the scaled, masked scores ``q . k_j * scale`` of one query row of head ``h`` and ``sinks[h]`` in the
same units (the sink is one more logit beside them, as gpt-oss concatenates it to the scaled logits)::

    p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sinks[h])),    out = sum_j p_j v_j

so a row's weights sum to less than one. With ``lse`` the log-sum-exp of the row's scores and ``o`` its ordinary
softmax output, the sink-corrected ones are ``lse' = logaddexp(lse, sink)`` and ``o' = o * exp(lse - lse')``; a row
that sees no key keeps ``o' = 0`` (``lse' = sink``). The kernels put the sink into their online softmax instead
(the running max starts at the sink and the denominator at 1: the sink is a key whose value is zero), so nothing
runs after them.

Backward. The sink's value is zero, so ``delta = rowsum(dO * o')`` is still ``sum_j p_j dP_j``, and the kernels'
backward, given ``lse'`` and ``delta`` from the corrected output, is unchanged. The sink's own gradient is that of
one more logit: ``d sinks[h] = -sum over rows of exp(sink - lse') * delta`` (:func:`sink_grad`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def check_sinks(sinks, num_heads: int):
    """``sinks`` (``None`` or ``[num_heads]`` floats) checked; raises ``ValueError`` naming the value and the fix."""
    if sinks is None:
        return None
    shape = tuple(getattr(sinks, "shape", ()))
    if shape != (num_heads,):
        raise ValueError(f"sinks must have shape [num_heads] = ({num_heads},), one logit per query head, got shape "
                         f"{shape}; pass sinks=None for attention without sinks")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be floating point (logits), got dtype {sinks.dtype}; cast them to float32")
    return sinks


def sink_rows(sinks) -> jax.Array:
    """``sinks [H]`` as float32 broadcasting against ``lse [b, H, s]`` (``[1, H, 1]``)."""
    return sinks.astype(_F32).reshape(1, -1, 1)


def with_sinks(o: jax.Array, lse: jax.Array, sinks) -> tuple[jax.Array, jax.Array]:
    """``(o [b, s, H, D], lse [b, H, s])`` of an ordinary softmax (natural log, ``-inf`` for a row that sees nothing)
    -> the same with the sink in the denominator: ``o * exp(lse - lse')``, ``lse' = logaddexp(lse, sink)``.
    ``sinks=None``: unchanged."""
    if sinks is None:
        return o, lse
    new = jnp.logaddexp(lse, sink_rows(sinks))
    w = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - jnp.where(new == -jnp.inf, 0.0, new)))  # [b, H, s]
    return (o * jnp.swapaxes(w, 1, 2)[..., None]).astype(o.dtype), new


def sink_grad(sinks, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """The sinks' gradient ``[H]`` (``sinks``' dtype): ``-sum_{b, s} exp(sink - lse') * delta`` from the corrected
    ``lse' [b, H, s]`` (natural log; ``-inf`` or ``+inf`` for a row that sees nothing) and ``delta [b, H, s]``."""
    sink = sink_rows(sinks)
    p = jnp.where(jnp.isinf(lse), 0.0, jnp.exp(sink - jnp.where(jnp.isinf(lse), 0.0, lse)))  # the sink's weight
    return -jnp.sum(p * delta.astype(_F32), axis=(0, 2)).astype(sinks.dtype)


def vary_like(sinks, like: jax.Array):
    """``sinks`` marked varying over the manual mesh axes that ``like`` varies over (inside ``shard_map`` with
    ``check_vma``; elsewhere unchanged), so that a ``custom_vjp`` whose gradient for them is computed from ``like``'s
    rows types it as the primal: the transpose of that cast sums the gradient over those axes."""
    missing = tuple(sorted(_varying(like) - _varying(sinks)))
    return jax.lax.pcast(sinks, missing, to="varying") if missing else sinks


def _varying(x) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; later versions name it vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))
