"""Held-out loss by position within each document: does the model use its context?

A token's position is its ``positions`` entry in the packed row: the number of tokens of its document (its piece, for
a document longer than ``seq_len``, which the model sees as a document of its own) before it. The loss at position
``p`` is that of predicting the document's token ``p + 1`` from its first ``p + 1`` tokens. Buckets are log-spaced:
``[0, 1), [1, 2), [2, 4), ..., [2^k, seq_len)``. Sums are taken in float64 on the host from the per-token losses
(``token_scores.py``), so the buckets' token-weighted mean is the overall loss to float64 rounding, and the numbers do
not depend on the mesh beyond the float32 arithmetic of the forward pass.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from ulysses_jax.data.pipeline import check_documents_per_row, eval_batches, process_rows, to_global
from ulysses_jax.evaluation.token_scores import to_host
from ulysses_jax.train.cluster import decide_together

RESULT = "eval_by_position.json"


def bucket_edges(seq_len: int) -> np.ndarray:
    """``[0, 1, 2, 4, ..., seq_len]``: the log-spaced bucket bounds for rows of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must be positive")
    edges = [0, 1]
    while edges[-1] * 2 < seq_len:
        edges.append(edges[-1] * 2)
    if edges[-1] < seq_len:
        edges.append(seq_len)
    return np.asarray(edges, np.int64)


class PositionLoss:
    """Accumulates per-token losses into position buckets (float64 sums, integer counts)."""

    def __init__(self, seq_len: int):
        self.edges = bucket_edges(seq_len)
        self.sums = np.zeros(len(self.edges) - 1, np.float64)
        self.counts = np.zeros(len(self.edges) - 1, np.int64)

    def add(self, loss_BS: np.ndarray, labels_BS: np.ndarray, positions_BS: np.ndarray) -> None:
        valid = np.asarray(labels_BS) >= 0
        pos = np.asarray(positions_BS)[valid]
        if pos.size and (pos.min() < 0 or pos.max() >= self.edges[-1]):
            raise ValueError(f"positions must be in [0, {self.edges[-1]}), got {pos.min()}..{pos.max()}")
        which = np.searchsorted(self.edges, pos, side="right") - 1
        n = len(self.counts)
        self.sums += np.bincount(which, weights=np.asarray(loss_BS, np.float64)[valid], minlength=n)
        self.counts += np.bincount(which, minlength=n)

    def result(self) -> dict:
        """``{"loss", "tokens", "buckets": [{"start", "end", "tokens", "loss"}, ...]}`` (empty buckets: loss None)."""
        total = int(self.counts.sum())
        if total == 0:
            raise ValueError("no eval tokens: the eval split is empty; raise --eval-fraction or give --eval-data")
        buckets = [{"start": int(a), "end": int(b), "tokens": int(c), "loss": float(s / c) if c else None}
                   for a, b, c, s in zip(self.edges[:-1], self.edges[1:], self.counts, self.sums)]
        return {"loss": float(self.sums.sum() / total), "tokens": total, "buckets": buckets}


def loss_by_position(token_step, params, data_cfg, mesh, *, seq_len: int, batch_size: int,
                     max_batches: int | None, doc_limit: int | None = None) -> dict:
    """The eval split's loss in position buckets (``PositionLoss.result()``) plus ``batches``: the same batches that
    ``eval_loss.evaluate_loss`` reads."""
    acc, batches = PositionLoss(seq_len), 0
    rows = process_rows(mesh, batch_size, seq_len)
    for local in eval_batches(data_cfg, seq_len=seq_len, global_batch=batch_size, max_batches=max_batches,
                              row_ids=rows):
        if doc_limit:  # the documents a row may hold for the step's cuDNN attention; this process's rows, refused
            decide_together(check_documents_per_row, local, doc_limit, rows=rows)  # on every process alike
        batch = to_global(local, mesh, global_batch=batch_size, row_ids=rows)
        loss_BS, _ = token_step(params, batch)
        acc.add(to_host(loss_BS), to_host(batch["labels"]), to_host(batch["positions"]))
        batches += 1
    return {**acc.result(), "batches": batches}


def loop_metrics(result: dict) -> dict:
    """The by-position result as flat ``eval_loss_pos_<start>_<end>`` keys for ``metrics.jsonl`` / TensorBoard."""
    return {f"eval_loss_pos_{b['start']}_{b['end']}": b["loss"] for b in result["buckets"] if b["loss"] is not None}


def write_result(run_dir, by_step: list[dict], meta: dict) -> pathlib.Path:
    """``eval_by_position.json``: the last evaluated step's ``loss`` and ``buckets`` at the top, and every step's in
    ``steps`` (one entry per ``--steps`` item)."""
    last = by_step[-1]
    out = {"step": last["step"], "loss": last["loss"], "tokens": last["tokens"], "buckets": last["buckets"],
           **meta, "steps": by_step}
    path = pathlib.Path(run_dir) / RESULT
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path
