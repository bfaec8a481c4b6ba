"""Interop layer: Hugging Face weights in and out (``from_hf`` / ``to_hf``: safetensors sliced per device, one tensor
at a time; each model family's rows name its tensors both ways).

May import: ``ulysses_jax.model`` (config, transformer, sharding of its parameters), ``ulysses_jax.data``
(tokenizers), ``ulysses_jax.parallel``.
Must not import: training, planning or the CLI.
"""
