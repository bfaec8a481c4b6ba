"""Planning layer: compile-only H100/H200 targets, the planner that compiles the training step for them, and the
readers of what XLA built (collectives from the HLO, kernels from the dump and ptxas), with the report it prints.

May import: everything below it (train, model, data, parallel, kernels).
Must not import: the CLI.
"""
