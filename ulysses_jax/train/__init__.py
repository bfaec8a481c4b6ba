"""Training layer: ``TrainConfig``, the devices a job runs on, the optimizer (master weights, state streamed from host
memory), the jitted step, the job and its loop, the run record, Orbax checkpoints, metrics and ``export``.

May import: model, data, interop, parallel, kernels.
Must not import: ``ulysses_jax.evaluation`` (it sits above: the in-training evaluations are handed to the trainer),
``ulysses_jax.plan`` or the CLI.
"""
