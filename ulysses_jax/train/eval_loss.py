"""The loss of a model over the evaluation split: the eval batches through the compiled eval step, token-weighted."""

from __future__ import annotations

import numpy as np

from ulysses_jax.data.documents import DataConfig
from ulysses_jax.data.pipeline import check_documents_per_row, eval_batches, process_rows, to_global
from ulysses_jax.train import cluster


def evaluate_loss(eval_step, params, data_cfg: DataConfig, mesh, *, seq_len: int, batch_size: int,
                  max_batches: int | None, doc_limit: int | None = None) -> dict:
    """The token-weighted mean loss of ``params`` over the eval split's batches (``eval_batches``), with perplexity,
    tokens and batches; ``doc_limit``: cuDNN's bound on documents per row that the step was compiled for."""
    total, count, batches = 0.0, 0, 0
    rows = process_rows(mesh, batch_size, seq_len)
    for local in eval_batches(data_cfg, seq_len=seq_len, global_batch=batch_size, max_batches=max_batches,
                              row_ids=rows):
        # this process's rows (one id for two runs; beyond cuDNN's bound), refused on every process alike
        cluster.decide_together(check_documents_per_row, local, doc_limit, rows=rows)
        s, c = eval_step(params, to_global(local, mesh, global_batch=batch_size, row_ids=rows))
        total, count, batches = total + float(s), count + int(c), batches + 1
    if count == 0:
        raise ValueError("no eval tokens: the eval split is empty; raise --eval-fraction or give --eval-data")
    loss = total / count
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 700.0))), "tokens": count, "batches": batches}
