"""Data layer: sources checked up front, tokenizers and their BOS/EOS conventions, SFT rendering with loss masks,
and the Grain pipeline that packs documents into rows and cuts each process's part of a global batch.

May import: ``ulysses_jax.parallel`` (mesh axis names, for the global batch), ``ulysses_jax.model`` (the
``config.json`` reader shared with the model's Hugging Face translation).
Must not import: training, interop, planning or the CLI.
"""
