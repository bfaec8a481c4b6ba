"""Documents against the row length, counted before training: SFT records longer than ``--seq-len`` (refused, or
dropped with ``--sft-overlong drop``) and plain-text documents cut into pieces.

An SFT record is never split across rows: its later pieces would hold answers with no question. With the default
``--sft-overlong refuse`` a record longer than ``--seq-len`` stops the run before anything is written, with the count
and the longest record; ``drop`` leaves such records out (training and eval) and the start-up lines say how many.
Plain-text documents longer than a row are cut into pieces of ``--seq-len`` tokens, each its own segment, as
pretraining does; the start-up lines say how many were.

Counting text documents needs their token counts; a document whose UTF-8 bytes (plus BOS and EOS) fit in a row is
not tokenized (the others are, in parallel batches): the tokenizers read here (UTF-8 bytes, byte-level BPE, byte-fallback SentencePiece) give at most one
token per byte, so it cannot be longer than a row.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import numpy as np

from ulysses_jax.data.documents import DataConfig, document_encoder, split_documents
from ulysses_jax.data.tokenizers import make_tokenizer

Overlong = Literal["refuse", "drop"]  # --sft-overlong: what an SFT record longer than --seq-len does


@dataclasses.dataclass(frozen=True)
class Lengths:
    """What ``measure`` found: documents longer than ``seq_len`` among ``documents`` (all splits)."""

    seq_len: int
    sft: bool
    documents: int
    over: int  # SFT records dropped, or text documents cut into pieces
    longest: int  # tokens of the longest document measured (text: of those longer than their bytes allow to skip)
    where: str = ""  # the longest over-long document, for messages
    over_train: int = 0  # of ``over``, those in the training split (the rest are held out or --eval-data)
    empty: int = 0  # SFT records with nothing to answer: an empty completion, or no assistant message with content
    empty_where: str = ""  # the first of them

    def __str__(self) -> str:
        if self.sft:
            if not self.over:
                return (f"no SFT record is longer than --seq-len {self.seq_len} (the longest: {self.longest} tokens)"
                        + self.empty_note())
            return (f"{self.over} of {self.documents} SFT records longer than --seq-len {self.seq_len} dropped "
                    f"(--sft-overlong drop; the longest: {self.longest} tokens, {self.where})" + self.empty_note())
        return (f"{self.over} of {self.documents} text documents longer than --seq-len {self.seq_len} are cut into "
                f"pieces of {self.seq_len} tokens" if self.over else
                f"no text document is longer than --seq-len {self.seq_len}")


    def empty_note(self) -> str:
        if not self.empty:
            return ""
        return (f"; {self.empty} of {self.documents} SFT records have an empty completion and train on the end-of-"
                f"sequence token alone (the first: {self.empty_where})")


def empty_completion(text: str) -> bool:
    """Whether an SFT record (a jsonl line) has nothing to answer: an empty completion, or no assistant message with
    content. Such a record still trains its end-of-sequence (or end-of-turn) tokens."""
    try:
        record = json.loads(text)
    except ValueError:
        return False  # refused with its own message when it is encoded
    if not isinstance(record, dict):
        return False

    def blank(messages) -> bool:
        return all(not isinstance(m, dict) or not str(m.get("content") or "").strip() for m in messages)

    completion = record.get("completion")
    if isinstance(completion, str):
        return not completion.strip()
    if isinstance(completion, list):
        return blank(completion)
    messages = record.get("messages")
    if isinstance(messages, list):
        return blank([m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"])
    return False


def _documents(cfg: DataConfig):
    """``(index, doc, flag, in the training split)`` of every document a run may read: the training split, the
    held-out and ``--eval-data``."""
    index, train = split_documents(cfg, "train")
    training = np.zeros(len(index), bool)
    training[train] = True
    for doc in range(len(index)):
        yield index, doc, "--data", bool(training[doc])
    if cfg.eval_paths:
        held, docs = split_documents(cfg, "eval")
        for doc in docs:
            yield held, int(doc), "--eval-data", False


def measure(cfg: DataConfig, seq_len: int, multiple: int = 1) -> Lengths:
    """Count the documents longer than ``seq_len`` tokens; an SFT record that is, under ``refuse``, raises
    ``ValueError`` with the count, the longest and the fix (module doc). ``multiple``: the run's sequence lengths
    keep the mesh when they are multiples of it, so the length advised is one."""
    sft = cfg.format == "sft"
    encode = document_encoder(cfg) if sft else None
    tok = None if sft or not cfg.tokenizer else make_tokenizer(cfg.tokenizer)
    slack = 0 if sft else len(document_encoder(cfg)(""))  # the BOS / EOS that frame a text document
    count = over = over_train = longest = empty = 0
    where, empty_where, batch = "", "", []

    def add(n: int, index, doc: int, flag: str, training: bool) -> None:
        nonlocal over, over_train, longest, where
        over += n > seq_len
        over_train += n > seq_len and training
        if n > longest:
            longest, where = n, index.where(doc, flag)

    def flush() -> None:  # text documents tokenized in parallel, a batch at a time
        for (index, doc, flag, training), n in zip(batch, tok.count([index.text(d) for index, d, _, _ in batch])):
            add(n + slack, index, doc, flag, training)
        batch.clear()

    for index, doc, flag, training in _documents(cfg):
        count += 1
        if sft:
            text = index.text(doc)
            add(len(encode(text)["tokens"]), index, doc, flag, training)
            if empty_completion(text):
                empty += 1
                empty_where = empty_where or index.where(doc, flag)
            continue
        size = len(index.text(doc).encode("utf-8")) + slack
        if tok is None:  # the tokens are the bytes
            add(size, index, doc, flag, training)
        elif size > seq_len:  # else it cannot be longer than a row (module doc)
            batch.append((index, doc, flag, training))
            if len(batch) == 64:
                flush()
    if batch:
        flush()
    if sft and over and over == count:
        raise ValueError(f"all {count} SFT records are longer than --seq-len {seq_len} (the longest: {longest} "
                         f"tokens, {where}); raise --seq-len")
    found = Lengths(seq_len, sft, count, over, longest, where if longest > seq_len else "", over_train, empty,
                    empty_where)
    if sft and over and cfg.sft_overlong != "drop":
        raise ValueError(
            f"{over} of {count} SFT records are longer than --seq-len {seq_len} (the longest: {longest} tokens, "
            f"{where}); a record is never split across rows (its later pieces would lose the prompt): raise --seq-len "
            f"to at least {longest}{_keeps_mesh(longest, multiple)}, or leave such records out with --sft-overlong drop")
    return found


def _keeps_mesh(length: int, multiple: int) -> str:
    if multiple <= 1 or length % multiple == 0:
        return ""
    return f" ({-(-length // multiple) * multiple}: a multiple of {multiple} keeps the sequence split over the mesh)"


def start_line(summary, found: Lengths) -> str:
    """The data line ``train`` prints at start. With SFT records dropped as over-long, its counts add up to the
    records read: kept for training + dropped from training + held out (of which some dropped too) = records."""
    if not (found.sft and found.over):
        return f"{summary}; {found}"
    held = (f"{summary.eval_documents} of --eval-data ({summary.eval_files} files)" if summary.eval_files
            else f"{summary.eval_documents} held out for eval")
    held_over = found.over - found.over_train
    return (f"{summary.files} files ({summary.bytes / 1e6:.1f} MB), {summary.documents} SFT records "
            f"({summary.empty} empty ones skipped): {summary.train_documents - found.over_train} kept for training, "
            f"{found.over_train} dropped as longer than --seq-len {found.seq_len} (--sft-overlong drop; the longest: "
            f"{found.longest} tokens, {found.where}), {held}" + (f" ({held_over} of them dropped too)" if held_over
                                                                   else "") + found.empty_note())
