"""Model families: one module per Hugging Face architecture (its config.json fields both ways with its refusals, the
rule that picks it on export, its tensor names, its presets), the helpers they share, and the registry that lists them.

May import: ``ulysses_jax.model.layer_kinds`` (layer types) and each other (a family built on another, e.g. Qwen3-MoE
on Qwen3). Must not import: ``ModelConfig`` (``model/config.py`` builds the presets from these plain dicts), the
transformer, or any layer above the model.
"""
