"""Model layer: ``ModelConfig`` with presets and the Hugging Face ``config.json`` translation (one module per model
family in ``families/``), the layer primitives (parameters born sharded, RoPE, RMSNorm), the NNX transformer, the
tiled sublayers and their chunk loops, host memory moves, the loss and FLOP counts.

May import: ``ulysses_jax.parallel`` and ``ulysses_jax.kernels``.
Must not import: data, training, interop (Hugging Face weights), planning or the CLI.
"""
