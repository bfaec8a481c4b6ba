"""The registry of model families: which modules are families, the order they are listed in, the order export asks
them in.

A family is one module of this package with the same small interface:

- ``ARCHITECTURE``, ``MODEL_TYPE``: the ``config.json`` ``architectures`` entry it reads and writes, and its
  ``model_type`` (which also finds it when ``architectures`` is absent);
- ``fields(raw, where, num_layers, head_dim) -> dict``: its ``ModelConfig`` fields of a ``config.json`` (``raw``, read
  from the file ``where``), refusing what it does not model; the shape every family has (sizes, heads, layers,
  vocabulary, norms' epsilon, tied embeddings) is the generic reader's (``model/hf_config.py``);
- ``claims(cfg, hint) -> bool``: whether export writes ``cfg`` as this family, asked in ``EXPORT_ORDER`` (the first
  that claims it wins); ``hint`` is the source folder's ``architectures``; raises ``ValueError`` for a model of its
  kind that it cannot hold;
- ``hf_config(cfg, dtype) -> dict``: the ``config.json`` it writes (the generic writer adds the token ids);
- ``ENTRIES``: its tensor names both ways (``model/families/tensors.py``), in the order export writes them;
- ``PRESETS``: published shapes, name -> ``ModelConfig`` fields (``rope_scaling`` a dict of ``RopeScaling``'s);
- optionally ``screen(raw, where)``: refuses a relative it does not read (asked of every folder first);
  ``language_config(raw, where)``: the ``config.json`` keys the generic reader reads (a vision-language folder's
  ``text_config``); ``wrap_config(text, source)``: the ``config.json`` export writes around the text model's;
  ``MODELLED_EXPERT_KEYS``: MoE keys refused elsewhere that it reads; ``IGNORED_PREFIXES``: tensors of its folders
  that import leaves unread; ``PASSTHROUGH_PREFIXES``: those export copies from the source folder unchanged.
"""

from __future__ import annotations

from ulysses_jax.model.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_5_vl,
    qwen3_moe,
    qwen3_next,
)

# as listed to the user ("use a model of ..."), and the order of ``hf_config.ARCHITECTURES``
FAMILIES = (llama, qwen2, qwen3, mistral, gemma3, qwen3_moe, mixtral, gpt_oss, qwen3_5, qwen3_5_moe, qwen3_next,
            qwen3_5_vl)
# the families export asks, in turn: the hybrids first (the vision-language folder's class when the source was one,
# the dense hybrid, Qwen3-Next's, Qwen3.5-MoE's), the norms after each sublayer, then the mixtures of experts
# (gpt-oss's experts, then qk-norm, then the rest), then the dense ones (qk-norm, q/k/v bias, a window or a Mistral
# source, Llama)
EXPORT_ORDER = (qwen3_5_vl, qwen3_5, qwen3_next, qwen3_5_moe, gemma3, gpt_oss, qwen3_moe, mixtral, qwen3, qwen2,
                mistral, llama)


def screen(raw: dict, where) -> None:
    """Ask every family with a ``screen`` to refuse the relatives it does not read (Gemma 3's vision-language
    folders), before the architecture is looked up."""
    for family in FAMILIES:
        if hasattr(family, "screen"):
            family.screen(raw, where)
