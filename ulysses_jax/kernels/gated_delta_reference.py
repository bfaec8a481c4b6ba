"""The gated delta rule token by token (``lax.scan`` over the sequence): the reference the chunked form is tested on.

Same contract as :func:`ulysses_jax.kernels.gated_delta.gated_delta_rule` (layout, gates, L2 norm and scaling,
segment ids), computed the way transformers' ``torch_recurrent_gated_delta_rule`` reads: per token, decay the state,
write ``beta_t k_t (v_t - S^T k_t)^T``, read ``o_t = S^T q_t``. At the first token of a document the state is zeroed
before the token's update. Key heads are repeated to the value heads here (a reference, not a kernel: it carries a
``[B, Hv, dk, dv]`` state through ``S`` sequential steps and, differentiated, keeps one per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ulysses_jax.kernels.gated_delta import check_inputs, compute_dtype, document_index, l2_normalize

_HIGHEST = lax.Precision.HIGHEST


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                          segment_ids: jax.Array | None = None, use_qk_l2norm: bool = True) -> jax.Array:
    """``o [B, S, Hv, dv]`` in ``q``'s dtype; computed in float32, or float64 for float64 inputs."""
    b, s, hk, dk, hv, dv = check_inputs(q, k, v, g, beta)
    dtype = q.dtype
    f = compute_dtype(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    q, k, v, g, beta = (x.astype(f) for x in (q, k, v, g, beta))
    q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)  # value head h reads key head h // n
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q / jnp.sqrt(jnp.asarray(dk, f))
    doc = document_index(segment_ids, b, s)
    keep = jnp.concatenate([jnp.zeros((b, 1), bool), doc[:, 1:] == doc[:, :-1]], axis=1)  # False: a new document
    factor = jnp.where(keep[..., None], jnp.exp(g), 0.0)  # [B, S, Hv]

    def token(state, xs):  # state [B, Hv, dk, dv]
        q_t, k_t, v_t, a_t, beta_t = xs
        state = state * a_t[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HIGHEST)
        state = state + k_t[..., :, None] * (beta_t[..., None] * (v_t - predicted))[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=_HIGHEST)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, factor, beta))
    _, o = lax.scan(token, jnp.zeros((b, hv, dk, dv), f), xs)
    return jnp.moveaxis(o, 0, 1).astype(dtype)
