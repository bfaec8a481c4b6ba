"""Parallel layer: the device mesh, the one logical-to-mesh axis table, which heads each device gets, the Ulysses
exchange (``seq_to_heads`` / ``heads_to_seq``) with attention around it, and the ring across nodes.

May import: ``ulysses_jax.kernels`` (the local attention it runs between the exchanges).
Must not import: the model, data, training, interop or planning layers.
"""
