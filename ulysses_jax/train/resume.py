"""What may change when a run continues (``train --resume``), and what may not.

A value that changes what the run learns (``LEARNED``: model, data, tokenizer, ``--init-from-hf`` folder, batch,
sequence length, seed, optimizer) is refused; everything else (mesh, memory tools, attention, steps, checkpointing,
evaluation, logging) may change. Data, tokenizer and the Hugging Face folder are compared by content, so a corpus or
folder that moved can be named with its new path. The record these rules read is ``runconfig.py``'s.
"""

from __future__ import annotations

import hashlib
import pathlib

from ulysses_jax.data.documents import sources_differ
from ulysses_jax.train.runconfig import COMPUTE_ONLY, flag, get

# TrainConfig fields that change what is learned: refused on resume when they differ from the record. Data and
# tokenizer are compared by content (fingerprints), not here.
LEARNED = ("preset", "seq_len", "batch_size", "seed", "data_field", "data_format", "eval_fraction", "optim.lr",
           "optim.warmup_steps", "optim.min_lr_ratio", "optim.weight_decay", "optim.clip_norm", "optim.b1", "optim.b2",
           "optim.master_weights", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
# what a record written before a LEARNED field existed meant by it
RECORDED_BEFORE = {"data_format": "text", "optim.master_weights": False, "lora_dropout": 0.0}
# ... and by a model field (run.json's "model")
MODEL_RECORDED_BEFORE = {"fp8": False, "fp8_recipe": "current"}


def learned_difference(recorded: dict, current: dict) -> str | None:
    """The first ``LEARNED`` setting that differs between two records' configs, as one phrase; else ``None``."""
    for path in LEARNED:
        a, b = get(recorded["config"], path), get(current["config"], path)
        a = RECORDED_BEFORE.get(path) if a is None else a
        if a != b:
            why_a, why_b = (r.get("defaults", {}).get(path, {}).get("why") for r in (recorded, current))
            was = f" ({why_a})" if why_a else ""
            if why_b:  # a value no flag gave here: say where each came from, and the flag that keeps the run's
                return (f"{flag(path)} is {b!r} here ({why_b}) but {a!r} in the run{was}; pass {flag(path)} {a!r} to "
                        f"keep the run's, or start a new --run-dir")
            return f"{flag(path)} is {b!r} here but {a!r} in the run{was}"
    a, b = recorded.get("model", {}), current.get("model", {})
    for key in sorted((set(a) | set(b)) - set(COMPUTE_ONLY)):  # a run recorded before a field became compute-only
        if a.get(key, MODEL_RECORDED_BEFORE.get(key)) != b.get(key, MODEL_RECORDED_BEFORE.get(key)):
            return f"the model's {key} is {b.get(key)!r} here but {a.get(key)!r} in the run"
    if recorded.get("optimizer") != current.get("optimizer"):
        return f"the optimizer is {current.get('optimizer')} here but {recorded.get('optimizer')} in the run"
    return None


HF_FOLDER_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


def describe_hf_folder(path: str, *, missing_ok: bool = False) -> dict | None:
    """``--init-from-hf`` as the run records it: the resolved path and a fingerprint of its settings files.

    The folder is compared by content, not by path (a folder that moved may be named anew), as data and tokenizers
    are. The fingerprint covers config.json (the model) and the files that frame and render documents (BOS/EOS,
    chat template); tokenizer.json has its own record (``tokenizer``). The weights are not hashed: they are
    gigabytes, and they are read at step 0 only (a resumed run takes its weights from its checkpoint).
    ``missing_ok`` (resuming): a folder that is gone gives None, the run's record then stands for it.
    """
    folder = pathlib.Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        if missing_ok:
            return None
        raise ValueError(f"--init-from-hf {path} has no config.json; pass a Hugging Face model folder")
    h = hashlib.blake2b(digest_size=16)
    for name in HF_FOLDER_FILES:
        f = folder / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"-") + b"\0")
    files = {n: hashlib.blake2b((folder / n).read_bytes(), digest_size=8).hexdigest() if (folder / n).is_file()
             else None for n in HF_FOLDER_FILES}
    return {"path": str(folder), "fingerprint": h.hexdigest(), "files": files}


def hf_difference(recorded: dict | None, current: dict | None) -> str | None:
    if (recorded or {}).get("fingerprint") == (current or {}).get("fingerprint"):
        return None
    if recorded is None:
        return f"--init-from-hf {current['path']} is given but the run was not started from a Hugging Face folder"
    if current is None:
        return f"the run was started from --init-from-hf {recorded['path']}"
    a, b = recorded.get("files", {}), current.get("files", {})
    changed = " and ".join(n for n in HF_FOLDER_FILES if a.get(n) != b.get(n)) if a else ""
    if current["path"] == recorded["path"]:  # the same folder, edited: say what changed, not a flag
        return (f"the folder's {changed or 'settings files'} changed since the run started ({current['path']}); "
                f"restore {'it' if ' and ' not in changed else 'them'}, or start a new --run-dir")
    return (f"--init-from-hf {current['path']} is not the run's folder {recorded['path']} (its "
            f"{changed or 'config.json, tokenizer_config.json, generation_config.json or chat template'} "
            f"{'differs' if changed and ' and ' not in changed else 'differ'})")


def tokenizer_difference(recorded: dict | None, current: dict) -> str | None:
    if recorded is None:
        return None
    if recorded.get("fingerprint") != current.get("fingerprint") or recorded.get("vocab_size") != current["vocab_size"]:
        return (f"--tokenizer {current['path'] or '(none: bytes)'} is not the run's tokenizer "
                f"({recorded.get('path') or 'bytes'}, vocabulary {recorded.get('vocab_size')})")
    return None


def same_run(recorded: dict, current: dict) -> str | None:
    """Why ``current`` (a record about to be written) does not continue the ``recorded`` run, or ``None``."""
    train = lambda ds: [d for d in ds if d.get("role") == "train"]  # noqa: E731
    return (learned_difference(recorded, current)
            or sources_differ(train(recorded.get("data", [])), train(current["data"]))
            or tokenizer_difference(recorded.get("tokenizer"), current["tokenizer"])
            or hf_difference(recorded.get("init_from_hf"), current.get("init_from_hf")))
