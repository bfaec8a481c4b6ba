"""Qwen3.5 as the Hub ships it (``Qwen3_5ForConditionalGeneration``, ``model_type`` ``qwen3_5``): a vision-language
folder whose language model trains here, and whose vision tower export copies through unchanged.

``config.json`` holds ``text_config`` (a Qwen3.5 text model: ``families/qwen3_5.py`` reads it) and ``vision_config``;
the language model's tensors are named ``model.language_model.*`` (``lm_head.weight`` stays at the top), the vision
tower's ``model.visual.*``. Import reads the language model alone (the vision tower's tensors are left unread, as
``mtp.*`` are). Export writes the same class: ``config.json`` is the source folder's with ``text_config`` replaced by
the trained model's, the language model's tensors are ours, and every ``model.visual.*`` tensor is copied from the
source folder byte for byte (``PASSTHROUGH_PREFIXES``), so the folder loads as the vision-language model it was. The
export takes this class only when the run's folder was of it (``claims``' hint).
"""

from __future__ import annotations

import dataclasses

from ulysses_jax.model.families import qwen3_5
from ulysses_jax.model.families.fields import refuse

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MODEL_TYPE = "qwen3_5"
HF_DEFAULTS = qwen3_5.HF_DEFAULTS  # of the text model (text_config)
PASSTHROUGH_PREFIXES = ("model.visual.",)  # not read on import; copied byte for byte on export
IGNORED_PREFIXES = (*PASSTHROUGH_PREFIXES, *qwen3_5.IGNORED_PREFIXES)
ENTRIES = tuple(dataclasses.replace(e, hf=e.hf.replace("model.", "model.language_model.", 1))
                if e.hf.startswith("model.") else e for e in qwen3_5.ENTRIES)


def language_config(raw: dict, where) -> dict:
    """The text model's ``config.json`` keys (``text_config``); tied embeddings from the top level if it has none."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        refuse(where, "text_config", text, "a vision-language Qwen3.5 folder holds its language model there")
    return {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **text}


def fields(raw: dict, where, num_layers: int, head_dim: int) -> dict:
    return qwen3_5.fields(raw, where, num_layers, head_dim)


def claims(cfg, hint) -> bool:
    """Only a model whose folder was of this class (asked first): the vision tower comes from that folder."""
    if hint != [ARCHITECTURE] or not qwen3_5.is_hybrid(cfg) or cfg.num_experts:
        return False
    qwen3_5.check_hybrid(cfg, ARCHITECTURE)
    return True


def hf_config(cfg, dtype: str) -> dict:
    """The text model's entries (``wrap_config`` puts them inside the source folder's ``config.json``)."""
    return qwen3_5.hf_config(cfg, dtype)


def wrap_config(text: dict, source: dict) -> dict:
    """The source folder's ``config.json`` with ``text_config`` replaced by the trained model's ``text``."""
    inner = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
    inner["model_type"] = qwen3_5.MODEL_TYPE
    if isinstance(source.get("text_config"), dict) and "rope_parameters" in source["text_config"]:
        # the source's multimodal RoPE sections (mrope_section), which the vision tower's positions need
        inner["rope_parameters"] = {**source["text_config"]["rope_parameters"], **inner["rope_parameters"]}
    return {**source, "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": inner,
            "tie_word_embeddings": text["tie_word_embeddings"], "dtype": text["dtype"]}


PRESETS: dict = {}
