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
logit one chunk at a time under ``jax.checkpoint``; only ``[b, loss_chunk, V]`` float32 logits exist at
once, forward and backward, never ``[B, S, V]``. Sums and counts are ``psum``-ed over all mesh axes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.model.config import local_chunks
from ulysses_jax.model.layers import wide_dot
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


def token_losses(logits_BSV: jax.Array, labels_BS: jax.Array) -> jax.Array:
    """``logsumexp(logits) - logits[label]`` per position in float32; 0 where the label is negative."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    label_logit_BS = jnp.take_along_axis(logits_BSV, jnp.maximum(labels_BS, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels_BS >= 0, lse_BS - label_logit_BS, 0.0)


def cross_entropy_sum(logits_BSV: jax.Array, labels_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of ``logsumexp(logits) - logits[label]`` over valid tokens, number of valid tokens)."""
    return jnp.sum(token_losses(logits_BSV, labels_BS)), jnp.sum(labels_BS >= 0, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_first(total, h, w, labels):
    """``total(h, w)``, whose backward reads ``h`` only after the value is computed. Left to plain autodiff, the
    forward loop over chunks (the value) and the backward loop (the gradient) are independent, and XLA schedules the
    value's loop last, after the layers' backward: the final hidden states (one ``[b, s, D]`` buffer) then stay on
    the device through the whole backward (the H100 buffer assignment, Llama-3.1-8B LoRA at 2M tokens)."""
    return total(h, w, labels)


def _loss_first_fwd(total, h, w, labels):
    value = total(h, w, labels)
    h, value = jax.lax.optimization_barrier((h, value))
    return value, (h, w, labels)


def _loss_first_bwd(total, res, ct):
    h, w, labels = res
    return (*jax.vjp(lambda h, w: total(h, w, labels), h, w)[1](ct), None)


_loss_first.defvjp(_loss_first_fwd, _loss_first_bwd)


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

        @jax.checkpoint
        def chunk_sum(h_bcD, labels_bc, w_VD):
            logits_bcV = wide_dot("bcd,vd->bcv", h_bcD, w_VD)
            return cross_entropy_sum(logits_bcV, labels_bc)[0]

        def total(h_nbcD, w_VD, labels_nbc):
            return jnp.sum(jax.lax.map(lambda xs: chunk_sum(*xs, w_VD), (h_nbcD, labels_nbc)))

        count = jnp.sum(labels_bs >= 0, dtype=jnp.int32)
        return jax.lax.psum(_loss_first(total, h_nbcD, w_VD, labels_nbc), MESH_AXES), jax.lax.psum(count, MESH_AXES)

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
    adds it weighted by ``router_aux_loss_coef``, as transformers' models do. ``dropout_key``: a training step's key
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
