"""Training data through Grain: documents -> tokens -> packed rows -> this process's part of a global batch.

Pipeline (each step a Grain dataset, so the iterator state is Grain's and a resumed run continues exactly):
  load_documents  ``MapDataset`` of ``(key, text)``: local ``.txt/.md/.py`` files (one document each), ``.jsonl``
                  lines, ``.parquet`` rows, or by default the Python standard library's own source files (one
                  document per file, nothing to download). Read lazily, UTF-8 with ``errors="replace"``.
  split           a document is held out for ``eval`` when a hash of its key falls below ``eval_fraction``.
                  Keys are paths relative to the given directory (a given file: its name; the built-in corpus:
                  the stdlib root), plus ``:line`` / ``:row``, so the split is the same on every machine.
  process shard   ``docs[process_index::process_count]`` before anything else: a process reads only its part.
  order           train: shuffled by ``seed`` (a new order each epoch), repeated forever; eval: one pass, in order.
                  Packed rows are shuffled again in a window (``shuffle_window``): consecutive pieces of one long
                  document would otherwise fill a batch.
  tokenize        UTF-8 bytes (vocab 256) or a Hugging Face ``tokenizer.json``; runs in Grain's reader threads.
  pack_rows       documents cut into pieces of at most ``seq_len`` tokens, first-fit packed into rows of exactly
                  ``seq_len`` tokens (``grain.experimental.FirstFitPackIterDataset``), labels shifted per row.
  batch           ``global_batch // process_count`` rows; ``to_global`` assembles the global ``[B, S]`` arrays.

A batch is a dict of int32 ``[rows, seq_len]`` arrays:
  tokens       token ids; 0 at padding
  segment_ids  1, 2, ... for the document pieces of a row, in order; 0 = padding (only at the row's end)
  positions    0, 1, ... restarting at each piece
  labels       ``tokens[t + 1]`` when ``t + 1`` is in the same piece, else ``IGNORE`` (a piece's last token, padding).
               Shifted on the whole row before the sequence split, so the last token of an ``sp`` shard keeps its
               target (the first token of the next shard). A piece cut from a long document starts a new segment.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterator
from typing import Literal

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulysses_jax.mesh import DATA, FSDP, SP

IGNORE = -1  # the same value as ulysses_jax.loss.IGNORE (checked by a test)
TEXT_SUFFIXES = (".txt", ".md", ".py")  # one file, one document
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
# Built-in corpus: directories skipped under the stdlib root (third-party packages, test suites).
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
Split = Literal["train", "eval"]
KEYS = ("tokens", "labels", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where documents come from and how they become rows (CLI: ``--data.<field>``)."""

    paths: tuple[str, ...] = ()  # files or directories of .txt .md .py .jsonl .parquet; empty: the stdlib corpus
    tokenizer: str | None = None  # a Hugging Face tokenizer.json (or a directory holding one); None: UTF-8 bytes
    text_field: str = "text"  # the text's key in .jsonl lines and column in .parquet files
    eval_fraction: float = 0.02  # share of documents held out for eval, chosen by a hash of each document's key
    shuffle: bool = True  # shuffle documents (anew each epoch) and packed rows in training; eval never shuffles
    pack_bins: int = 16  # rows that first-fit packing fills at once: more bins, less padding, more host memory
    shuffle_window: int = 64  # packed rows shuffled together in training, so that a batch mixes documents; 0: off
    read_threads: int = 4  # Grain threads that read and tokenize documents
    prefetch: int = 32  # documents read and tokenized ahead of the packer


# ---------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to load."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "replace"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", "replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library; no special tokens are added."""

    def __init__(self, path: str | os.PathLike):
        import tokenizers

        self.path = str(path)
        self._tok = tokenizers.Tokenizer.from_file(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """``None`` -> bytes; a ``tokenizer.json`` file, or a directory containing one -> ``HFTokenizer``."""
    if path is None:
        return ByteTokenizer()
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer {p} does not exist; pass a Hugging Face tokenizer.json with --data.tokenizer")
    return HFTokenizer(p)


# ---------------------------------------------------------------------------------------------- documents


@dataclasses.dataclass(frozen=True)
class _Doc:
    key: str  # stable document name: path relative to its root, plus ":line" (jsonl) or ":row" (parquet)
    path: str
    kind: Literal["text", "jsonl", "parquet"]
    loc: tuple[int, int] = (0, 0)  # jsonl: (byte offset, line number); parquet: (row group, row in group)


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus_files() -> list[pathlib.Path]:
    """Sorted ``*.py`` files under the stdlib root, skipping the directories in ``STDLIB_SKIP``."""
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        files += [pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _corpus_files(cfg: DataConfig) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """``(file, root)`` pairs; keys are the files' paths relative to their root."""
    if not cfg.paths:
        root = stdlib_root()
        return [(f, root) for f in stdlib_corpus_files()]
    out = []
    for p in map(pathlib.Path, cfg.paths):
        if p.is_dir():
            out += [(f, p) for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in SUFFIXES]
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ValueError(
                    f"data file {p} has an unknown extension {p.suffix!r}; pass {' '.join(SUFFIXES)} files "
                    "with --data.paths"
                )
            out.append((p, p.parent))
        else:
            raise ValueError(
                f"data path {p} does not exist; pass existing files or directories with --data.paths, "
                "or none for the built-in corpus"
            )
    return out


def _jsonl_docs(f: pathlib.Path, rel: str) -> list[_Doc]:
    docs, offset = [], 0
    with open(f, "rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                docs.append(_Doc(f"{rel}:{line_no}", str(f), "jsonl", (offset, line_no)))
            offset += len(line)
    return docs


def _parquet_docs(f: pathlib.Path, rel: str, field: str) -> list[_Doc]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    if field not in pf.schema_arrow.names:
        raise ValueError(
            f"parquet file {f} has no column {field!r} (it has {pf.schema_arrow.names}); "
            "name the text column with --data.text_field"
        )
    docs, row = [], 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        docs += [_Doc(f"{rel}:{row + i}", str(f), "parquet", (g, i)) for i in range(n)]
        row += n
    return docs


def _index(cfg: DataConfig) -> list[_Doc]:
    docs = []
    for f, root in _corpus_files(cfg):
        rel = f.relative_to(root).as_posix()
        if f.suffix == ".jsonl":
            docs += _jsonl_docs(f, rel)
        elif f.suffix == ".parquet":
            docs += _parquet_docs(f, rel, cfg.text_field)
        else:
            docs.append(_Doc(rel, str(f), "text"))
    if not docs:
        where = ", ".join(cfg.paths) or str(stdlib_root())
        raise ValueError(
            f"no documents found in {where}; pass files or directories holding {' '.join(SUFFIXES)} files "
            "with --data.paths"
        )
    return docs


@functools.lru_cache(maxsize=8)
def _parquet_group(path: str, group: int, field: str) -> list:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(group, columns=[field]).column(0).to_pylist()


def _read(doc: _Doc, field: str) -> str:
    if doc.kind == "text":
        return pathlib.Path(doc.path).read_bytes().decode("utf-8", "replace")
    if doc.kind == "parquet":
        text = _parquet_group(doc.path, doc.loc[0], field)[doc.loc[1]]
        return "" if text is None else str(text)
    with open(doc.path, "rb") as fh:
        fh.seek(doc.loc[0])
        line = fh.readline().decode("utf-8", "replace")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {doc.loc[1]} of {doc.path} is not JSON ({e}); write one JSON object per line") from None
    if not isinstance(record, dict) or field not in record:
        raise ValueError(
            f"line {doc.loc[1]} of {doc.path} has no field {field!r}; name the text field with --data.text_field"
        )
    return "" if record[field] is None else str(record[field])


def _held_out(key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return h < fraction * 2**64


def _check_config(cfg: DataConfig) -> None:
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={cfg.eval_fraction} must be in [0, 1); e.g. 0.02 holds out 2%")
    for name in ("pack_bins", "shuffle_window", "read_threads", "prefetch"):
        value, least = getattr(cfg, name), 1 if name == "pack_bins" else 0
        if not isinstance(value, int) or value < least:
            raise ValueError(f"data.{name}={value!r} must be an integer >= {least}")


def load_documents(cfg: DataConfig, split: Split = "train") -> grain.MapDataset:
    """``MapDataset`` of ``(key, text)`` for one split, in corpus order; texts are read when indexed."""
    _check_config(cfg)
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} must be 'train' or 'eval'")
    every = _index(cfg)
    docs = [d for d in every if _held_out(d.key, cfg.eval_fraction) == (split == "eval")]
    if not docs:
        fix = "raise --data.eval_fraction or add documents" if split == "eval" else "lower --data.eval_fraction"
        raise ValueError(f"the {split} split is empty ({len(every)} documents, eval_fraction={cfg.eval_fraction}); "
                         f"{fix}")
    field = cfg.text_field
    return grain.MapDataset.source(docs).map(lambda d: (d.key, _read(d, field)))


# ---------------------------------------------------------------------------------------------- packing


def next_token_labels(tokens: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """``labels[..., t] = tokens[..., t + 1]`` within a segment; ``IGNORE`` at a segment's end and at padding."""
    labels = np.full(tokens.shape, IGNORE, np.int32)
    same = (segment_ids[..., 1:] == segment_ids[..., :-1]) & (segment_ids[..., :-1] > 0)
    labels[..., :-1] = np.where(same, tokens[..., 1:], IGNORE)
    return labels


class _Pieces(grain.experimental.FlatMapTransform):
    """A token array -> ``{"tokens": piece}`` for consecutive pieces of at most ``seq_len`` tokens."""

    max_fan_out = 1  # not used by FlatMapIterDataset

    def __init__(self, seq_len: int, max_empty_run: int | None):
        self.seq_len, self.max_empty_run, self._empty_run = seq_len, max_empty_run, 0

    def flat_map(self, tokens):
        tokens = np.asarray(tokens, np.int32)
        self._empty_run = 0 if len(tokens) else self._empty_run + 1
        if self.max_empty_run is not None and self._empty_run > self.max_empty_run:
            raise ValueError(f"{self._empty_run} documents in a row have no tokens; check the data files")
        return [{"tokens": tokens[i : i + self.seq_len]} for i in range(0, len(tokens), self.seq_len)]


def _finish_row(row: dict) -> dict:
    tokens, segment_ids = row["tokens"].astype(np.int32), row["tokens_segment_ids"].astype(np.int32)
    return {
        "tokens": tokens,
        "labels": next_token_labels(tokens, segment_ids),
        "segment_ids": segment_ids,
        "positions": row["tokens_positions"].astype(np.int32),
    }


def pack_rows(
    docs: grain.IterDataset,
    seq_len: int,
    *,
    bins: int = 16,
    seed: int = 0,
    shuffle: bool = False,
    max_empty_run: int | None = None,
) -> grain.IterDataset:
    """1-D token arrays of any length -> rows (dicts of int32 ``[seq_len]``: see the module doc).

    Documents longer than ``seq_len`` are cut into ``seq_len`` pieces, each its own segment (Grain's packer
    rejects longer ones). ``bins`` rows are filled first-fit; ``shuffle`` permutes them by ``seed``.
    ``max_empty_run``: raise after that many token-less documents in a row (a repeated empty corpus never ends).
    """
    pieces = grain.experimental.FlatMapIterDataset(docs, _Pieces(seq_len, max_empty_run))
    rows = grain.experimental.FirstFitPackIterDataset(
        pieces, length_struct={"tokens": seq_len}, num_packing_bins=bins, seed=seed, shuffle_bins=shuffle
    )
    return rows.map(_finish_row)


# ---------------------------------------------------------------------------------------------- batches


def _empty_rows(n: int, seq_len: int) -> dict[str, np.ndarray]:
    rows = {k: np.zeros((n, seq_len), np.int32) for k in KEYS}
    rows["labels"][:] = IGNORE
    return rows


class BatchIterator:
    """This process's rows of each global batch: ``global_batch // process_count`` packed rows per ``next``.

    ``split="train"``: documents shuffled by ``seed`` (anew each epoch), repeated forever. ``split="eval"``: one
    pass in corpus order, then ``StopIteration``; the last batch is filled up with padding rows (all ``IGNORE``).
    ``get_state`` / ``set_state``: Grain's iterator state plus the settings it belongs to, JSON-serialisable.
    """

    def __init__(
        self,
        cfg: DataConfig,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        split: Split = "train",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        pi = jax.process_index() if process_index is None else process_index
        pc = jax.process_count() if process_count is None else process_count
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be positive")
        if pc < 1 or not 0 <= pi < pc:
            raise ValueError(f"process_index ({pi}) must be in [0, process_count={pc})")
        if global_batch % pc:
            raise ValueError(
                f"global_batch ({global_batch}) must be divisible by the process count ({pc}); "
                f"choose a multiple of {pc}"
            )
        self.cfg, self.seq_len, self.rows = cfg, seq_len, global_batch // pc
        self.process_index, self.process_count = pi, pc
        self.tokenizer = make_tokenizer(cfg.tokenizer)
        docs = load_documents(cfg, split)
        shard = docs[pi::pc]
        train = split == "train"
        if train and len(shard) == 0:
            raise ValueError(f"process {pi} of {pc} gets none of the {len(docs)} training documents; add documents")
        n_shard = len(shard)
        if train:
            shard = (shard.shuffle(seed % 2**32) if cfg.shuffle else shard).repeat(None)
        tok = self.tokenizer
        tokens = shard.map(lambda doc: tok.encode(doc[1])).to_iter_dataset(
            grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch)
        )
        rows = pack_rows(
            tokens, seq_len, bins=cfg.pack_bins, seed=seed % 2**32, shuffle=train and cfg.shuffle,
            max_empty_run=2 * n_shard if train else None,  # longer: no document has a token (runs span <= 2 epochs)
        )
        if train and cfg.shuffle and cfg.shuffle_window > 1:
            rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=cfg.shuffle_window, seed=seed % 2**32)
        self._it = rows.batch(self.rows, drop_remainder=train).__iter__()
        self._settings = dict(
            split=split, seq_len=seq_len, rows=self.rows, seed=seed, process_index=pi, process_count=pc,
            documents=len(docs), vocab_size=self.vocab_size,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._it)
        n = batch["tokens"].shape[0]
        if n < self.rows:  # the last eval batch
            pad = _empty_rows(self.rows - n, self.seq_len)
            batch = {k: np.concatenate([batch[k], pad[k]]) for k in KEYS}
        return {k: batch[k] for k in KEYS}

    def get_state(self) -> dict:
        return {"grain": self._it.get_state(), **self._settings}

    def set_state(self, state: dict) -> None:
        for key, value in self._settings.items():
            if state.get(key) != value:
                raise ValueError(
                    f"data state was saved with {key}={state.get(key)!r} but this iterator has {key}={value!r}; "
                    "resume with the same data settings"
                )
        self._it.set_state(state["grain"])


def eval_batches(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    max_batches: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """One deterministic pass over the held-out documents: local batches, at most ``max_batches``.

    With several processes every one must run the same number of steps: ``max_batches`` is then required, and a
    process whose documents run out yields padding batches (all labels ``IGNORE``) up to it.
    """
    it = BatchIterator(
        cfg, seq_len=seq_len, global_batch=global_batch, seed=0, split="eval",
        process_index=process_index, process_count=process_count,
    )  # fmt: skip
    if max_batches is None and it.process_count > 1:
        raise ValueError(
            f"eval over {it.process_count} processes needs max_batches, so that every process runs the same "
            "number of steps"
        )

    def gen():
        n = 0
        for batch in it:
            if max_batches is not None and n >= max_batches:
                return
            yield batch
            n += 1
        while it.process_count > 1 and n < max_batches:
            yield _empty_rows(it.rows, seq_len)
            n += 1

    return gen()


def to_global(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """This process's ``[rows, S]`` arrays -> global ``[rows * process_count, S]`` arrays on ``mesh``.

    Sharded ``P(("data", "fsdp"), "sp")``: the batch over ``data x fsdp``, the sequence over ``sp``. Assumes each
    process's devices hold whole rows (``sp`` groups within a host, as ``make_mesh`` orders them).
    """
    sharding = NamedSharding(mesh, P((DATA, FSDP), SP))
    out = {}
    for key, local in batch.items():
        rows, seq = local.shape
        shape = (rows * jax.process_count(), seq)
        if shape[0] % (mesh.shape[DATA] * mesh.shape[FSDP]):
            raise ValueError(
                f"global batch ({shape[0]}) must be divisible by data x fsdp ({mesh.shape[DATA] * mesh.shape[FSDP]})"
            )
        if seq % mesh.shape[SP]:
            raise ValueError(f"sequence length ({seq}) must be divisible by sp ({mesh.shape[SP]})")
        out[key] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out
