"""Evaluation layer: what a trained run is worth. The ``eval`` job (``evaluate``: loss, loss by position, passkey
retrieval, an lm-eval-harness task file), the per-token scores it reads (``token_scores``), the position buckets
(``position``), the passkey samples and scorer (``passkey``, ``passkey_eval``), the plots (``plots``) and the
in-training evaluations (``loop``: handed to the trainer, ``ulysses_jax.evaluation.loop.train``).

May import: train, model, data, interop, parallel, kernels.
Must not import: ``ulysses_jax.plan`` or the CLI.
"""
