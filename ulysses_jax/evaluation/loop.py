"""Long-context checks inside the training loop: ``--eval-by-position`` and ``--eval-passkey`` beside ``--eval-every``.

``LoopEval.setup`` checks everything (the tokenizer writes digits, the trained length holds a passkey sample) before
the run writes anything; ``LoopEval.metrics(params)`` returns flat ``eval_*`` keys that the loop adds to the step's
record, so they reach ``metrics.jsonl``, TensorBoard (``eval/``) and W&B beside ``eval_loss``: the loss of each
position bucket (``eval_loss_pos_<start>_<end>``) and the passkey accuracy at the trained length over the depths
0, 0.25, 0.5, 0.75, 1 (``eval_passkey_accuracy``, ``eval_passkey_depth_<d>``).
"""

from __future__ import annotations

import dataclasses

from ulysses_jax.evaluation import passkey_eval, position
from ulysses_jax.evaluation.token_scores import make_token_step
from ulysses_jax.train import trainer

LOOP_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclasses.dataclass
class LoopEval:
    token_step: object
    data_cfg: object
    mesh: object
    seq_len: int
    batch_size: int
    max_batches: int
    by_position: bool
    passkey: dict | None  # run_passkey's keyword arguments, or None
    doc_limit: int | None = None  # documents a row may hold for the step's cuDNN attention (None: any)

    @classmethod
    def setup(cfg, train_cfg, *, graphdef, mesh, param_shardings, data_cfg, batch_size: int,
              doc_limit: int | None = None) -> LoopEval | None:
        """None unless ``--eval-every`` and ``--eval-by-position`` or ``--eval-passkey`` are given."""
        if not train_cfg.eval_every or not (train_cfg.eval_by_position or train_cfg.eval_passkey):
            return None
        task = None
        if train_cfg.eval_passkey:
            if train_cfg.eval_passkey_samples < 1:
                raise ValueError(f"--eval-passkey-samples ({train_cfg.eval_passkey_samples}) must be at least 1")
            hf = {"init_from_hf": {"path": train_cfg.init_from_hf}} if train_cfg.init_from_hf else {}
            fmt, _ = passkey_eval.prompt_format(hf, train_cfg.tokenizer)
            if fmt.fixed_tokens(5) > train_cfg.seq_len:
                raise ValueError(f"--eval-passkey: --seq-len {train_cfg.seq_len} is too short for a passkey sample "
                                 f"(at least {fmt.fixed_tokens(5)} tokens with this tokenizer); drop --eval-passkey")
            task = dict(fmt=fmt, filler=passkey_eval.filler_tokens(fmt, "fixed", data_cfg, train_cfg.seq_len),
                        lengths=(train_cfg.seq_len,), depths=LOOP_DEPTHS, samples=train_cfg.eval_passkey_samples,
                        seed=train_cfg.seed, digits=5)
        step = make_token_step(graphdef, mesh, param_shardings)
        return cfg(step, data_cfg, mesh, train_cfg.seq_len, batch_size, train_cfg.eval_batches,
                   train_cfg.eval_by_position, task, doc_limit)

    def metrics(self, params) -> dict:
        out = {}
        if self.by_position:
            res = position.loss_by_position(self.token_step, params, self.data_cfg, self.mesh,
                                                 seq_len=self.seq_len, batch_size=self.batch_size,
                                                 max_batches=self.max_batches, doc_limit=self.doc_limit)
            out.update(position.loop_metrics(res))
        if self.passkey is not None:
            res = passkey_eval.run_passkey(self.token_step, params, self.mesh, **self.passkey, seq_len=self.seq_len,
                                           batch_size=self.batch_size, doc_limit=self.doc_limit)
            out.update(passkey_eval.loop_metrics(res))
        return out


def train(cfg) -> dict:
    """``ulysses_jax.train.trainer.train`` with the in-training evaluations of ``--eval-by-position`` and
    ``--eval-passkey`` (what ``ulysses-jax train`` runs)."""
    return trainer.train(cfg, loop_eval_setup=LoopEval.setup)
