"""Per-token scores of a batch: each token's next-token loss and whether the greedy prediction is its label.

The loss-by-position evaluation and the passkey scorer read these instead of the batch's summed loss. The model runs
as in training (Ulysses over ``sp``, the ring, the tiled sublayers and remat of its config); with ``loss_chunk`` the
logits exist one chunk of ``loss_chunk`` tokens per device at a time, as in the tiled loss, never ``[B, S, V]``. The
outputs are ``[B, S]`` arrays in the batch's own token order (a ring's permutation is undone), sharded like the batch;
a position with a negative label has loss 0 and hit False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ulysses_jax.model.config import local_chunks
from ulysses_jax.model.loss import token_losses
from ulysses_jax.parallel.mesh import DATA, FSDP, SEQ
from ulysses_jax.parallel.sharding import fsdp_axes, gather_param
from ulysses_jax.train.step import batch_sharding


def greedy_scores(logits_BSV: jax.Array, labels_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(``logsumexp(logits) - logits[label]``, ``argmax(logits) == label``) per position; 0 and False where the
    label is negative."""
    hit_BS = (labels_BS >= 0) & (jnp.argmax(logits_BSV, axis=-1) == jnp.maximum(labels_BS, 0))
    return token_losses(logits_BSV, labels_BS), hit_BS


def tiled_greedy_scores(h_BSD: jax.Array, w_VD: jax.Array, labels_BS: jax.Array, *, mesh: Mesh, chunk: int,
                        over_data: bool = False) -> tuple[jax.Array, jax.Array]:
    """``greedy_scores(h @ w.T, labels)`` with only ``[b, chunk, V]`` logits per device at once (``w_VD`` at rest)."""
    batch = (DATA, FSDP)

    def local(h_bsD, w_VD, labels_bs):
        w_VD = gather_param(w_VD, 1, over_data=over_data)
        b, s, d = h_bsD.shape
        n = local_chunks(chunk, s, "loss_chunk")
        h_nbcD = h_bsD.reshape(b, n, chunk, d).swapaxes(0, 1)
        labels_nbc = labels_bs.reshape(b, n, chunk).swapaxes(0, 1)

        def one(xs):
            h_bcD, labels_bc = xs
            logits_bcV = jnp.einsum("bcd,vd->bcv", h_bcD, w_VD, preferred_element_type=jnp.float32)
            return greedy_scores(logits_bcV, labels_bc)

        loss_nbc, hit_nbc = jax.lax.map(one, (h_nbcD, labels_nbc))
        return loss_nbc.swapaxes(0, 1).reshape(b, s), hit_nbc.swapaxes(0, 1).reshape(b, s)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(batch, SEQ, None), P(None, fsdp_axes(over_data)), P(batch, SEQ)),
                       out_specs=(P(batch, SEQ), P(batch, SEQ)))
    return fn(h_BSD, w_VD, labels_BS)


def token_scores(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """``(loss_BS float32, hit_BS bool)`` of ``model`` on ``batch`` (``tokens``, shifted ``labels``, ``segment_ids``,
    ``positions``), in the batch's token order."""
    labels_BS = batch["labels"]
    ordered = model.ring_order(batch) if hasattr(model, "ring_order") else None
    if ordered is not None:  # compute in the ring's order, as the loss does, and undo it at the end
        labels_BS = ordered["labels"]
        hidden = model.hidden_states(ordered["tokens"], positions=ordered["positions"],
                                     segment_ids=ordered.get("segment_ids"), permuted=True)
    else:
        hidden = model.hidden_states(batch["tokens"], positions=batch.get("positions"),
                                     segment_ids=batch.get("segment_ids"))
    cfg = model.config
    if cfg.loss_chunk:
        w_VD = model.unembedding.get_value().astype(cfg.compute_jnp_dtype)
        loss_BS, hit_BS = tiled_greedy_scores(hidden, w_VD, labels_BS, mesh=model.mesh, chunk=cfg.loss_chunk,
                                              over_data=cfg.shard_params_over_data)
    else:
        loss_BS, hit_BS = greedy_scores(model.logits(hidden), labels_BS)
    if ordered is not None:
        back = np.argsort(model.ring_permutation(labels_BS.shape[1]))
        loss_BS, hit_BS = loss_BS[:, back], hit_BS[:, back]
    return loss_BS, hit_BS


def make_token_step(graphdef, mesh: Mesh, param_sh):
    """``token_step(params, batch) -> (loss_BS, hit_BS)``, jitted, outputs sharded like the batch."""
    bsh = batch_sharding(mesh)

    def step(params, batch):
        return token_scores(nnx.merge(graphdef, params), batch)

    return jax.jit(step, in_shardings=(param_sh, bsh), out_shardings=(bsh, bsh))


def to_host(x_BS: jax.Array) -> np.ndarray:
    """The whole global ``[B, S]`` array on this host (gathered from every process when there are several)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x_BS, tiled=True))
    return np.asarray(x_BS)
