"""Next-token cross-entropy over the whole global batch, plain or tiled.

Labels are shifted *before* the sequence is split: a batch carries ``tokens [B, S]`` and ``labels [B, S]``
where ``labels[b, t]`` is the token that follows ``tokens[b, t]``, so the token at a shard's last position
keeps its label although the next token lives on another device. With a ring (``mesh.ring > 1``) the batch,
labels included, is permuted once here into the model's token order (``Transformer.ring_order``, zigzag): a sum
over tokens does not depend on their order, so the loss and the gradients are unchanged. A negative label
(``IGNORE = -1``, or Hugging Face's ``-100``) marks a position with no target: padding, the last token of a
document in a packed row, the last position of a row. ``shift_labels`` builds them from tokens and segment ids.

The loss is a token-weighted mean over every device: ``sum of per-token losses / number of valid
tokens`` of the global batch, never a mean of per-shard means. A shard or row without a valid token
adds 0 to the sum and to the count; a batch with none gives ``loss = 0``, never NaN. ``next_token_loss``
returns the ``sum`` and the ``count`` as well, so gradient accumulation normalises by tokens: add the
gradients of ``sum`` over micro-batches and divide by the added ``count``.

Tiled loss (``ModelConfig.loss_chunk``): inside ``shard_map``, each device cuts its local ``[b, S/sp, D]``
hidden states into chunks of ``loss_chunk`` tokens and computes logits, log-sum-exp and the label's
logit one chunk at a time; only ``[b, loss_chunk, V]`` float32 logits exist at once, never ``[B, S, V]``. Under
differentiation each chunk's gradients come with its value (``fused_cross_entropy_sum``): the logits are computed
once, and read twice after their GEMM writes them: once for their log-sum-exp (``one_pass_logsumexp``: the maximum and
the sum in one reduction) and once to write their gradient. Sums and counts are ``psum``-ed over all mesh axes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.kernels.sinks import vary_like
from ulysses_jax.model.config import local_chunks
from ulysses_jax.model.layers import cotangent_dtype
from ulysses_jax.model.moe import aux_loss, expert_load
from ulysses_jax.parallel.mesh import DATA, FSDP, MESH_AXES, SEQ
from ulysses_jax.parallel.sharding import fsdp_axes, gather_param

IGNORE = -1


class LossOutput(NamedTuple):
    loss: jax.Array  # sum / max(count, 1), float32; with experts + router_aux_loss_coef * aux_loss (the objective)
    sum: jax.Array  # sum of per-token losses over the global batch, float32
    count: jax.Array  # number of valid (non-negative) labels in the global batch, int32
    aux_loss: jax.Array | None = None  # with experts: the load-balancing loss, unweighted (model/moe.py)
    expert_load: jax.Array | None = None  # with experts: top-k assignments per expert over the sparse layers [E]


def shift_labels(tokens_BS: jax.Array, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """``labels[:, t] = tokens[:, t + 1]``; ``IGNORE`` at the last position and at each document's last token.

    Call it on the whole (unsplit) batch, before the sequence is sharded. Segment ids are only compared,
    so padding that shares an id keeps next-token labels: mask it yourself (the data pipeline's own
    labels, ``data.next_token_labels``, already ignore its padding, segment id 0).
    """
    ignore = jnp.full_like(tokens_BS[:, :1], IGNORE)
    labels_BS = jnp.concatenate([tokens_BS[:, 1:], ignore], axis=1)
    if segment_ids_BS is not None:
        same_doc = jnp.concatenate([segment_ids_BS[:, 1:] == segment_ids_BS[:, :-1], ignore == 0], axis=1)
        labels_BS = jnp.where(same_doc, labels_BS, IGNORE)
    return labels_BS


def _losses_given_lse(logits_BSV: jax.Array, labels_BS: jax.Array, lse_BS: jax.Array) -> jax.Array:
    """``lse - logits[label]`` per position (the label's logit a gather); 0 where the label is negative."""
    label_logit_BS = jnp.take_along_axis(logits_BSV, jnp.maximum(labels_BS, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels_BS >= 0, lse_BS - label_logit_BS, 0.0)


def _losses_and_lse(logits_BSV: jax.Array, labels_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(token_losses, logsumexp(logits))``, float32."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    return _losses_given_lse(logits_BSV, labels_BS, lse_BS), lse_BS


def token_losses(logits_BSV: jax.Array, labels_BS: jax.Array) -> jax.Array:
    """``logsumexp(logits) - logits[label]`` per position in float32; 0 where the label is negative."""
    return _losses_and_lse(logits_BSV, labels_BS)[0]


def cross_entropy_sum(logits_BSV: jax.Array, labels_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of ``logsumexp(logits) - logits[label]`` over valid tokens, number of valid tokens)."""
    return jnp.sum(token_losses(logits_BSV, labels_BS)), jnp.sum(labels_BS >= 0, dtype=jnp.int32)


@jax.custom_jvp
def one_pass_logsumexp(x: jax.Array) -> jax.Array:
    """``logsumexp`` over the last axis of ``x`` in float32, in one reduction: each element enters as ``(x, 1)`` and two
    partial results ``(m, s)`` (a maximum and the sum of ``exp`` relative to it) combine as the online softmax does,
    ``(max(m1, m2), s1 exp(m1 - m) + s2 exp(m2 - m))``. XLA reduces the maximum and the sum of ``jax.nn.logsumexp``
    in two passes, each reading all of ``x``; this reads it once (the tiled loss: a chunk's float32 logits, 2 GiB for
    4096 tokens of a 128K vocabulary). The start value is the lowest finite float32, not ``-inf``, so that two start
    values combine to ``(lowest, 0)``, not NaN. Finite ``x`` gives ``jax.nn.logsumexp``'s value up to rounding, a row
    of ``-inf`` gives ``-inf``; ``+inf`` or NaN in a row gives NaN (the training loop stops on a non-finite loss either
    way). Differentiable: its derivative is the softmax of ``x`` (a rule of its own; XLA's variadic reduction has
    none)."""
    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)

    start = (jnp.array(jnp.finfo(jnp.float32).min, jnp.float32), jnp.array(0.0, jnp.float32))
    x = x.astype(jnp.float32)
    m, s = jax.lax.reduce((x, jnp.ones_like(x)), start, combine, (x.ndim - 1,))
    return m + jnp.log(s)


@one_pass_logsumexp.defjvp
def _one_pass_logsumexp_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    lse = one_pass_logsumexp(x)
    p = jnp.exp(x.astype(jnp.float32) - lse[..., None])
    return lse, jnp.sum(p * dx.astype(jnp.float32), axis=-1)


def _chunk_loss_sum(logits_bcV: jax.Array, labels_bc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of a chunk's float32 token losses, its log-sum-exps)``: ``cross_entropy_sum``'s sum with the one-pass
    log-sum-exp."""
    lse_bc = one_pass_logsumexp(logits_bcV)
    return jnp.sum(_losses_given_lse(logits_bcV, labels_bc, lse_bc)), lse_bc


def _chunk(h_bcD, w_VD, labels_bc, grad_w: bool):
    """One chunk of the fused loss: ``(sum of its token losses, d sum / d h, d sum / d w or None)``. The logits'
    gradient, ``softmax - onehot(label)`` (0 at ignored labels), is rounded to bfloat16 before its two GEMMs where
    the operands are bfloat16 (``layers.cotangent_dtype``), as ``layers.wide_dot``'s backward does."""
    logits_bcV = jnp.einsum("bcd,vd->bcv", h_bcD, w_VD, preferred_element_type=jnp.float32)
    total, lse_bc = _chunk_loss_sum(logits_bcV, labels_bc)
    onehot_bcV = jnp.arange(logits_bcV.shape[-1]) == jnp.maximum(labels_bc, 0)[..., None]
    d_bcV = jnp.exp(logits_bcV - lse_bc[..., None]) - onehot_bcV
    d_bcV = jnp.where((labels_bc >= 0)[..., None], d_bcV, 0.0).astype(cotangent_dtype(h_bcD, w_VD))
    dh_bcD = jnp.einsum("bcv,vd->bcd", d_bcV, w_VD, preferred_element_type=jnp.float32).astype(h_bcD.dtype)
    dw_VD = jnp.einsum("bcv,bcd->vd", d_bcV, h_bcD, preferred_element_type=jnp.float32) if grad_w else None
    return total, dh_bcD, dw_VD


def _fused_loop(h_nbcD, w_VD, labels_nbc, grad_w: bool):
    """Every chunk in turn: ``(sum, d sum / d h [n, b, c, D], d sum / d w summed over the chunks, or None)``. The
    unembedding's gradient is summed in float32 and rounded to ``w``'s dtype once, after the last chunk: summed in
    bf16, its error grew with the chunks (relative 1.5e-3 for one chunk, 4e-3 for 8, 2e-2 for 256: a million tokens in
    chunks of 4096), as autodiff's transposed scan had summed it."""
    def body(carry, xs):
        (total, dw_VD), (h_bcD, labels_bc) = carry, xs
        t, dh_bcD, dw = _chunk(h_bcD, w_VD, labels_bc, grad_w)
        return (total + t, dw_VD if dw is None else dw_VD + dw), dh_bcD

    def zeros(shape, dtype):  # typed as the body's sums: varying over the mesh axes h and w vary over
        return vary_like(vary_like(jnp.zeros(shape, dtype), h_nbcD), w_VD)

    carry = (zeros((), jnp.float32), zeros(w_VD.shape if grad_w else (), jnp.float32))
    (total, dw_VD), dh_nbcD = jax.lax.scan(body, carry, (h_nbcD, labels_nbc))
    return total, dh_nbcD, dw_VD.astype(w_VD.dtype) if grad_w else None


@jax.custom_vjp
def fused_cross_entropy_sum(h_nbcD, w_VD, labels_nbc):
    """The sum of the token losses of ``h @ w.T`` over chunks ``[n, b, c, D]`` (labels ``[n, b, c]``), one chunk's
    float32 logits at a time. Under differentiation the forward computes the gradients too, chunk by chunk (the
    unembedding's only where it trains: LoRA's frozen one gets none), and the backward scales them by the cotangent:
    the logits are computed once, where autodiff of a checkpointed chunk computed them again in the backward
    (one GEMM and the log-sum-exp's reductions per chunk more), and the hidden states are read by the forward alone,
    whose loop XLA then runs before the layers' backward rather than after it."""
    def body(total, xs):
        logits_bcV = jnp.einsum("bcd,vd->bcv", xs[0], w_VD, preferred_element_type=jnp.float32)
        return total + _chunk_loss_sum(logits_bcV, xs[1])[0], None

    zero = vary_like(vary_like(jnp.zeros((), jnp.float32), h_nbcD), w_VD)
    return jax.lax.scan(body, zero, (h_nbcD, labels_nbc))[0]


def _fused_fwd(h_nbcD, w_VD, labels_nbc):
    grad_w = w_VD.perturbed
    total, dh_nbcD, dw_VD = _fused_loop(h_nbcD.value, w_VD.value, labels_nbc.value, grad_w)
    return total, (dh_nbcD, dw_VD)


def _fused_bwd(res, ct):
    dh_nbcD, dw_VD = res
    ct = jnp.zeros((), jnp.float32) if isinstance(ct, jax.custom_derivatives.SymbolicZero) else ct.astype(jnp.float32)
    scaled_dw = None if dw_VD is None else (ct * dw_VD.astype(jnp.float32)).astype(dw_VD.dtype)
    return (ct * dh_nbcD.astype(jnp.float32)).astype(dh_nbcD.dtype), scaled_dw, None


fused_cross_entropy_sum.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def tiled_cross_entropy_sum(
    h_BSD: jax.Array, w_VD: jax.Array, labels_BS: jax.Array, *, mesh: Mesh, chunk: int, over_data: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``cross_entropy_sum(h @ w.T, labels)`` without materialising the logits (see the module doc).

    ``w_VD`` comes in its at-rest layout (``embed`` split over ``fsdp_axes(over_data)``) and is all-gathered
    once per call; its gradient leaves as a reduce-scatter.
    """
    wa = fsdp_axes(over_data)
    batch = (DATA, FSDP)

    def local(h_bsD, w_VD, labels_bs):
        w_VD = gather_param(w_VD, 1, over_data=over_data)
        b, s, d = h_bsD.shape
        n = local_chunks(chunk, s, "loss_chunk")
        h_nbcD = h_bsD.reshape(b, n, chunk, d).swapaxes(0, 1)
        labels_nbc = labels_bs.reshape(b, n, chunk).swapaxes(0, 1)

        count = jnp.sum(labels_bs >= 0, dtype=jnp.int32)
        total = fused_cross_entropy_sum(h_nbcD, w_VD, labels_nbc)
        return jax.lax.psum(total, MESH_AXES), jax.lax.psum(count, MESH_AXES)

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(P(batch, SEQ, None), P(None, wa), P(batch, SEQ)), out_specs=(P(), P())
    )
    return fn(h_BSD, w_VD, labels_BS)


def next_token_loss(model, batch: dict, *, hidden: jax.Array | None = None, router=None,
                    dropout_key: jax.Array | None = None) -> LossOutput:
    """Token-weighted mean cross-entropy of ``model`` on ``batch`` over the whole global batch.

    ``batch``: ``tokens`` and ``labels`` ``[B, S]`` (labels already shifted, negative = ignored), optional
    ``segment_ids`` and ``positions``. ``hidden``: the model's ``hidden_states`` if already computed (with experts,
    ``router``: the ``RouterStats`` computed with them, else no load-balancing loss). Tiled when
    ``model.config.loss_chunk > 0``. Returns ``LossOutput``: with experts the load-balancing loss too, and ``loss``
    adds it weighted by ``router_aux_loss_coef`` (transformers' models add it only with
    ``output_router_logits=True``; training here always does). ``dropout_key``: a training step's key
    for LoRA's dropout (``Transformer.hidden_and_router``).
    """
    tokens_BS, labels_BS = batch["tokens"], batch["labels"]
    if tuple(labels_BS.shape) != tuple(tokens_BS.shape):
        raise ValueError(f"labels shape {tuple(labels_BS.shape)} must equal the tokens' {tuple(tokens_BS.shape)}")
    # with a ring the model computes in its token order: permute the batch, labels included, once, here
    ordered = model.ring_order(batch) if hidden is None and hasattr(model, "ring_order") else None
    if ordered is not None:
        labels_BS = ordered["labels"]
        hidden, router = model.hidden_and_router(ordered["tokens"], positions=ordered["positions"],
                                                 segment_ids=ordered.get("segment_ids"), permuted=True,
                                                 dropout_key=dropout_key)
    elif hidden is None:
        hidden, router = model.hidden_and_router(tokens_BS, positions=batch.get("positions"),
                                                 segment_ids=batch.get("segment_ids"), dropout_key=dropout_key)
    cfg = model.config
    with jax.named_scope("loss"):  # a profile's category (experiments/profile_step.py)
        if cfg.loss_chunk:
            w_VD = model.unembedding.get_value().astype(cfg.compute_jnp_dtype)
            total, count = tiled_cross_entropy_sum(
                hidden, w_VD, labels_BS, mesh=model.mesh, chunk=cfg.loss_chunk, over_data=cfg.shard_params_over_data
            )
        else:
            total, count = cross_entropy_sum(model.logits(hidden), labels_BS)
    mean = total / jnp.maximum(count, 1).astype(jnp.float32)
    if router is None:
        return LossOutput(mean, total, count)
    aux = aux_loss(router)
    return LossOutput(mean + cfg.router_aux_loss_coef * aux, total, count, aux, expert_load(router))
