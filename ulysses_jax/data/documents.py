"""Training documents: the data settings, the sources checked up front, the train / held-out split, and each document's
encoding (tokens, or an SFT record's tokens and loss mask).

``validate_sources(cfg)`` reads and checks every source once, streaming, before the run directory exists (every
problem one ``ValueError`` naming the flag); ``describe_sources(cfg)`` is what a run records (content fingerprints
included) and ``sources_differ(recorded, current)`` says why other data is not the run's data. A document is held out
for eval when a 64-bit hash of its *text* falls below ``eval_fraction`` (the same split however a path is written, on
every machine). Packing the documents into rows is ``pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Literal

import grain
import numpy as np

from ulysses_jax.data.sft import SFTRenderer
from ulysses_jax.data.sources import Index, build_index
from ulysses_jax.data.tokenizers import make_tokenizer, tokenizer_conventions, tokenizer_folder

IGNORE = -1  # the same value as ulysses_jax.model.loss.IGNORE (checked by a test)
Split = Literal["train", "eval", "held_out"]  # held_out: the held-out fraction, even where eval_paths is given
DataFormat = Literal["text", "sft"]  # text: loss on every token; sft: records of ulysses_jax.data.sft, loss on answers



@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where documents come from and how they become rows (the first five are the CLI flags named beside them)."""

    paths: tuple[str, ...] = ()  # --data: files or directories (module doc); empty: the stdlib corpus
    tokenizer: str | None = None  # --tokenizer: a Hugging Face tokenizer.json (or a directory holding one); None: bytes
    text_field: str = "text"  # --data-field: the text's key in .jsonl lines and column in .parquet files
    eval_fraction: float = 0.02  # --eval-fraction: share of documents held out, chosen by a hash of each one's text
    eval_paths: tuple[str, ...] = ()  # --eval-data: a separate validation source; the eval split is all of it
    format: DataFormat = "text"  # --data-format: sft reads .jsonl SFT records (data/sft.py) with their loss masks
    sft_overlong: Literal["refuse", "drop"] = "refuse"  # --sft-overlong: an SFT record longer than a row (lengths.py)
    frame: bool = False  # frame text documents as the tokenizer folder's model was trained: [bos] + text + [eos]
    shuffle: bool = True  # shuffle documents (anew each epoch) and packed rows in training; eval never shuffles
    pack_bins: int = 16  # rows that first-fit packing fills at once: more bins, less padding, more host memory
    shuffle_window: int = 64  # packed rows shuffled together in training (over all rows of a batch); 0: off
    read_threads: int = 4  # Grain threads that read and tokenize documents
    prefetch: int = 32  # documents read and tokenized ahead of the packer


def _check_config(cfg: DataConfig) -> None:
    for name, flag in (("paths", "--data"), ("eval_paths", "--eval-data")):
        value = getattr(cfg, name)
        if isinstance(value, (str, pathlib.Path)) or not all(isinstance(p, (str, pathlib.Path)) for p in value):
            raise ValueError(f"{flag} takes a list of paths, not {value!r}")
    if not isinstance(cfg.eval_fraction, (int, float)) or not 0.0 <= cfg.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction {cfg.eval_fraction} must be in [0, 1); e.g. 0.02 holds out 2% of documents")
    if not isinstance(cfg.text_field, str) or not cfg.text_field:
        raise ValueError(f"--data-field {cfg.text_field!r} must name the text field of .jsonl/.parquet data, e.g. text")
    if cfg.format not in ("text", "sft"):
        raise ValueError(f"--data-format {cfg.format!r} must be text or sft")
    if cfg.sft_overlong not in ("refuse", "drop"):
        raise ValueError(f"--sft-overlong {cfg.sft_overlong!r} must be refuse or drop")
    if cfg.sft_overlong != "refuse" and cfg.format != "sft":
        raise ValueError(f"--sft-overlong {cfg.sft_overlong} decides what happens to SFT records longer than a row, "
                         f"but --data-format is {cfg.format} (text documents are cut into rows); add --data-format sft "
                         f"or drop --sft-overlong")
    for name in ("pack_bins", "shuffle_window", "read_threads", "prefetch"):
        value, least = getattr(cfg, name), 1 if name == "pack_bins" else 0
        if not isinstance(value, int) or value < least:
            raise ValueError(f"DataConfig.{name}={value!r} must be an integer >= {least}")




def document_encoder(cfg: DataConfig):
    """A document's text -> int32 ``[T]`` tokens (``format="text"``), or -> ``{"tokens", "loss_mask"}`` (``"sft"``).

    ``frame``: text documents are framed with the tokenizer folder's BOS/EOS (``hf.TokenizerConventions.frame``);
    SFT records are framed by ``sft.SFTRenderer`` (its prompt/completion rule or the chat template) either way.
    """
    if cfg.format == "sft":
        renderer = SFTRenderer(tokenizer_folder(cfg.tokenizer, "--data-format sft"))

        def encode(text: str) -> dict[str, np.ndarray]:
            example = renderer.record(json.loads(text))
            return {"tokens": example.tokens, "loss_mask": example.loss_mask.astype(np.int32)}

        return encode
    tok = make_tokenizer(cfg.tokenizer)
    if not cfg.frame:
        return tok.encode
    conventions = tokenizer_conventions(tokenizer_folder(cfg.tokenizer, "framing documents with BOS/EOS"))
    return lambda text: conventions.frame(tok.encode(text))


def _check_sft(cfg: DataConfig, index: Index, eval_index: Index | None) -> None:
    """Render every SFT record once (roles, chat template, ...); the first bad one names its file and line."""
    encode = document_encoder(cfg)
    for idx, flag in ((index, "--data"), (eval_index, "--eval-data")):
        for doc in range(len(idx) if idx is not None else 0):
            try:
                encode(idx.text(doc))
            except ValueError as e:
                raise ValueError(f"{idx.where(doc, flag)}: {e}") from None


# ---------------------------------------------------------------------------------------------- sources


def _indexes(cfg: DataConfig) -> tuple[Index, Index | None]:
    """The training sources' index and, with ``eval_paths``, the validation sources' (cached, see build_index)."""
    _check_config(cfg)
    sft = cfg.format == "sft"
    # the validation sources first: where they are the training ones too (`eval --eval-data`), refusals name that flag
    held = build_index(cfg.eval_paths, field=cfg.text_field, flag="--eval-data", sft=sft) if cfg.eval_paths else None
    return build_index(cfg.paths, field=cfg.text_field, flag="--data", sft=sft), held


def held_out(digests: np.ndarray, fraction: float) -> np.ndarray:
    """Which documents (by the 64-bit hash of their text) are held out for eval: ``fraction`` of them."""
    return np.asarray(digests, np.uint64) < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


def split_documents(cfg: DataConfig, split: Split) -> tuple[Index, np.ndarray]:
    """The index a split reads and its document numbers in that index, in corpus order."""
    if split not in ("train", "eval", "held_out"):
        raise ValueError(f"split {split!r} must be 'train', 'eval' or 'held_out'")
    index, eval_index = _indexes(cfg)
    if split == "eval" and eval_index is not None:
        return eval_index, np.arange(len(eval_index))
    held = held_out(index.digest, cfg.eval_fraction)
    docs = np.flatnonzero(~held if split == "train" else held)
    if not len(docs):
        if split == "train":
            raise ValueError(f"all {len(index)} documents are held out for eval (--eval-fraction {cfg.eval_fraction}); "
                             "lower --eval-fraction or add documents with --data")
        raise ValueError(
            f"none of the {len(index)} documents is held out (--eval-fraction {cfg.eval_fraction}); raise "
            "--eval-fraction, add documents with --data, or give a validation source with --eval-data"
        )
    return index, docs


def load_documents(cfg: DataConfig, split: Split = "train") -> grain.MapDataset:
    """``MapDataset`` of ``(key, text)`` for one split, in corpus order; texts are read when indexed.

    Keys are names for people (a file's path relative to the directory given, plus ``:line`` for jsonl and ``:row``
    for parquet); the split does not depend on them.
    """
    index, docs = split_documents(cfg, split)
    return grain.MapDataset.source(docs).map(lambda d: (index.key(int(d)), index.text(int(d))))


@dataclasses.dataclass(frozen=True)
class SourceSummary:
    """What ``validate_sources`` found (``--data``, or the built-in corpus; ``eval_*``: the eval split)."""

    files: int
    documents: int  # non-empty documents
    bytes: int
    empty: int  # empty documents skipped
    train_documents: int  # documents left for training (those not held out)
    eval_documents: int  # the eval split: all of --eval-data, or the held-out documents
    eval_files: int = 0  # --eval-data's files and bytes (0 without it)
    eval_bytes: int = 0
    eval_overlap: int = 0  # --eval-data documents whose text is also in the training split
    vocab_size: int = 256
    replaced: int = 0  # invalid UTF-8 sequences read as U+FFFD, in all the sources
    replaced_files: int = 0  # the files that hold them

    def __str__(self) -> str:
        held = (f"eval on {self.eval_documents} documents of --eval-data ({self.eval_files} files)"
                if self.eval_files else f"{self.eval_documents} held out for eval")
        return (f"{self.files} files ({self.bytes / 1e6:.1f} MB), {self.documents} documents "
                f"({self.empty} empty ones skipped): {self.train_documents} for training, {held}")


def validate_sources(cfg: DataConfig, *, need_eval: bool = False) -> SourceSummary:
    """Read and check every source and the tokenizer once, before the job writes anything; raise ``ValueError``.

    Streaming (one document in memory at a time); the index it builds is cached for the iterators that follow.
    ``need_eval``: also refuse an empty eval split (for ``eval`` and evaluation during training).
    """
    vocab = make_tokenizer(cfg.tokenizer).vocab_size
    index, eval_index = _indexes(cfg)
    if cfg.format == "sft":
        _check_sft(cfg, index, eval_index)
    elif cfg.frame:
        document_encoder(cfg)  # the folder's BOS/EOS conventions can be read
    _, train = split_documents(cfg, "train")
    if eval_index is not None:
        evals = len(eval_index)
    elif need_eval:
        evals = len(split_documents(cfg, "eval")[1])  # raises when no document is held out
    else:
        evals = len(index) - len(train)
    replaced = [index.replaced] + ([eval_index.replaced] if eval_index is not None else [])
    summary = SourceSummary(len(index.files), len(index), index.bytes, index.empty, len(train), evals, vocab_size=vocab,
                            replaced=sum(r[0] for r in replaced), replaced_files=sum(r[1] for r in replaced))
    if eval_index is None:
        return summary
    overlap = int(np.isin(eval_index.digest, index.digest[train]).sum())
    return dataclasses.replace(summary, eval_files=len(eval_index.files), eval_bytes=eval_index.bytes,
                               eval_overlap=overlap)


def describe_sources(cfg: DataConfig) -> list[dict]:
    """The sources as the run should record them: one dict per path given (or the built-in corpus).

    Keys: ``role`` ("train": --data, "eval": --eval-data), ``path`` (resolved, absolute), ``kind`` (file, directory,
    builtin), ``files``, ``bytes``, ``documents`` and ``fingerprint`` (a hash of the documents' texts in order, so
    the same data under another name is the same, and an edited file is not). JSON-serialisable.
    """
    index, eval_index = _indexes(cfg)
    out = [dict(role="train", **d) for d in index.describe(builtin=not cfg.paths)]
    if eval_index is not None:
        out += [dict(role="eval", **d) for d in eval_index.describe(builtin=False)]
    return out


def sources_differ(recorded: list[dict], current: list[dict]) -> str | None:
    """``None`` when ``current`` holds the same documents as ``recorded`` (``describe_sources``), else why not."""
    for role, flag in (("train", "--data"), ("eval", "--eval-data")):
        a, b = ([d for d in ds if d.get("role") == role] for ds in (recorded, current))
        if [d.get("fingerprint") for d in a] == [d.get("fingerprint") for d in b]:
            continue
        names = lambda ds: " ".join(d["path"] for d in ds) or "none"  # noqa: E731
        if len(a) != len(b):
            return f"the run's {flag} is {names(a)}, this is {names(b)}"
        x, y = next((x, y) for x, y in zip(a, b) if x.get("fingerprint") != y.get("fingerprint"))
        if x["path"] == y["path"]:
            return (f"{flag} {x['path']} has changed since the run ({x['documents']} documents, fingerprint "
                    f"{str(x.get('fingerprint'))[:12]} then; {y['documents']}, {str(y.get('fingerprint'))[:12]} now)")
        return f"{flag} {y['path']} ({y['documents']} documents) is not the run's {x['path']} ({x['documents']})"
    return None
