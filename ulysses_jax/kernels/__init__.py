"""Kernels layer: local (single-device) attention behind one ``attention(..., impl=)``: the XLA reference, the
blockwise ``lax`` kernel and the Pallas flash-attention kernels with their block sizes; the grouped matmul; the
gated delta rule (linear attention) and its short causal convolution.

May import: nothing of the package (each kernel file only its own block sizes); jax and numpy only.
Must not import: anything above it (parallel, model, data, train, interop, plan, cli).
"""
