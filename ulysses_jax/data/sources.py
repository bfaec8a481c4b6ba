"""Training sources: paths -> files -> an index of documents, checked in one streaming pass before training.

Accepted formats (``--data PATH...``, and ``--eval-data PATH...`` for a separate validation source):

  ``.txt`` ``.md`` ``.markdown`` ``.py``  one document per file.
  ``.jsonl``    one JSON object per line, the text under the field named by ``--data-field`` (default ``text``);
                blank lines are skipped.
  ``.parquet``  one document per row, the text in the string column named by ``--data-field``.

  With ``--data-format sft``, ``.jsonl`` files only: each line is one SFT record (``{"prompt", "completion"}`` or
  ``{"messages"}``, see ``ulysses_jax.data.sft``), kept as canonical JSON: the record is the document's text.

  A path may be a file or a directory; directories are searched recursively, in name order, for these extensions
  (other files, and hidden files and directories, are skipped). A file named twice (say directly and through its
  directory) is read once. Text is UTF-8 with or without a byte-order mark: a leading BOM is removed from each file,
  each jsonl line and each document; bytes that are not UTF-8 become U+FFFD. Empty documents (no text, only
  whitespace, or a null field) are skipped. Without ``--data`` the corpus is this Python's standard library source,
  each ``.py`` file a document.

Everything is read once before training starts, streaming (one document in memory at a time), and each problem stops
the run with one ``ValueError`` naming the file, the line and the fix: a path that does not exist, an unknown
extension, a directory without such files, a line that is not a JSON object, a missing or non-string text field, a
source with only empty documents, a file that cannot be read or is not parquet.

The index keeps, per document, numpy entries only (about 20 bytes: where it starts in its file, its jsonl line, and a
64-bit hash of its text). The hash is the document's identity: it chooses the held-out split, so the split depends on
the text alone, never on how a path was written, and it fingerprints the data for the run record.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import sysconfig
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".py")  # one file, one document
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
# Built-in corpus: directories skipped under the stdlib root (third-party packages, test suites).
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
BOM = "\ufeff"
FIELD_FLAG = "--data-field"
Format = Literal["text", "jsonl", "parquet"]


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus_files() -> list[pathlib.Path]:
    """Sorted ``*.py`` files under the stdlib root, skipping the directories in ``STDLIB_SKIP``."""
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        files += [pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


# ---------------------------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # resolved absolute path
    name: str  # path relative to the source it was found in (a file named directly: its name); documents' keys
    format: Format
    source: int  # which of the given paths it came from
    size: int  # bytes
    stamp: tuple[int, int]  # (inode, mtime in ns): with size and path, what the index cache checks


def _format(path: pathlib.Path) -> Format | None:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    return suffix[1:] if suffix in SUFFIXES else None  # type: ignore[return-value]


def _walk(root: pathlib.Path) -> list[pathlib.Path]:
    """Files with an accepted extension under ``root``, recursively, in name order; hidden ones skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [pathlib.Path(dirpath, f) for f in filenames if not f.startswith(".") and _format(pathlib.Path(f))]
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def _source_file(path: pathlib.Path, name: str, source: int) -> SourceFile:
    st = path.stat()
    return SourceFile(str(path), name, _format(path), source, st.st_size, (st.st_ino, st.st_mtime_ns))


def list_files(paths: Sequence[str], flag: str) -> tuple[tuple[str, ...], tuple[SourceFile, ...]]:
    """The given paths resolved (``()``: the stdlib root) and the files they name, in order, each file once."""
    if not paths:
        root = stdlib_root()
        return (str(root.resolve()),), tuple(
            _source_file(f.resolve(), f.relative_to(root).as_posix(), 0) for f in stdlib_corpus_files()
        )
    sources, files, seen = [], [], set()
    for given in paths:
        p = pathlib.Path(given).expanduser()
        if p.is_dir():
            found = [(f, f.relative_to(p).as_posix()) for f in _walk(p)]
            if not found:
                raise ValueError(
                    f"{flag} {given}: the directory holds no {' '.join(SUFFIXES)} files; "
                    f"pass a directory or files of those kinds with {flag}"
                )
        elif p.is_file():
            if _format(p) is None:
                raise ValueError(
                    f"{flag} {given} has an unknown extension {p.suffix!r}; pass {' '.join(SUFFIXES)} files "
                    f"(one JSON object per line: .jsonl) with {flag}"
                )
            found = [(p, p.name)]
        else:
            raise ValueError(f"{flag} {given} does not exist; pass existing files or directories with {flag}")
        sources.append(str(p.resolve()))
        for f, name in found:
            f = f.resolve()
            if f not in seen:
                seen.add(f)
                files.append(_source_file(f, name, len(sources) - 1))
    return tuple(sources), tuple(files)


# ---------------------------------------------------------------------------------------------- documents


def digest(text: str) -> int:
    """64-bit hash of a document's text (as ``clean_text`` leaves it): its identity for the split and fingerprints."""
    return int.from_bytes(hashlib.blake2b(clean_text(text).encode("utf-8"), digest_size=8).digest(), "little")


def fingerprint(digests: np.ndarray) -> str:
    """Hex fingerprint of a sequence of document hashes (their texts, in order)."""
    h = hashlib.blake2b(digest_size=16)
    for i in range(0, len(digests), 1 << 20):
        h.update(np.ascontiguousarray(digests[i : i + (1 << 20)], "<u8").tobytes())
    return h.hexdigest()


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """A document's text as it is hashed and tokenized: no leading BOM; lone surrogates (JSON "\\ud800") -> U+FFFD."""
    text = text.removeprefix(BOM)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def _blank(text: str | None) -> bool:
    return not text or text.isspace()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").removeprefix(BOM)


def not_utf8(raw: bytes) -> int:
    """U+FFFD characters that decoding ``raw`` as UTF-8 brings in (a U+FFFD written in the file is not counted)."""
    return 0 if raw.isascii() else _text(raw).count("\ufffd") - raw.count("\ufffd".encode())


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _json_line(raw: bytes, where: str, flag: str):
    """One jsonl line parsed; a syntax error names the column within the line (1-based, as editors count)."""
    line = _text(raw).rstrip("\r\n")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        at = "the end of the line" if e.pos >= len(line.rstrip()) else f"column {e.pos + 1}"
        what = e.msg.removesuffix(" at")  # "Unterminated string starting at": the position follows once
        raise ValueError(f"{where} is not valid JSON ({what} at {at}); fix it (one JSON object per line) or leave the "
                         f"file out of {flag}") from None


def _jsonl_text(raw: bytes, field: str, where: str, flag: str = "--data") -> str | None:
    """The text of one jsonl line (``None``: null); ``where`` ("line 3 of FILE") names it in errors."""
    record = _json_line(raw, where, flag)
    if not isinstance(record, dict):
        kind = "null" if record is None else _JSON_TYPES.get(type(record), type(record).__name__)
        raise ValueError(
            f"{where} is a JSON {kind}, not an object; write one JSON object per line with the text under {field!r}"
        )
    if field not in record:
        names = ", ".join(map(repr, list(record)[:8])) + (", ..." if len(record) > 8 else "") or "none"
        if {"prompt", "completion"} <= set(record) or "messages" in record:
            raise ValueError(f"{where} is an SFT record (its fields: {names}), not text under {field!r}; train on SFT "
                             f"records with --data-format sft (and the model's folder: --init-from-hf or --tokenizer)")
        raise ValueError(f"{where} has no field {field!r} (its fields: {names}); name the text field with {FIELD_FLAG}")
    value = record[field]
    if value is not None and not isinstance(value, str):
        kind = _JSON_TYPES.get(type(value), type(value).__name__)
        raise ValueError(
            f"field {field!r} in {where} is a JSON {kind}, not a string; name a text field with {FIELD_FLAG}"
        )
    return value


def _sft_record(raw: bytes, where: str, flag: str = "--data") -> str:
    """An SFT line (``--data-format sft``) as canonical JSON, its document text; its shape checked, not rendered."""
    record = _json_line(raw, where, flag)
    if not isinstance(record, dict) or not ({"prompt", "completion"} <= set(record) or "messages" in record):
        shape = f"fields {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ValueError(f"{where} is not an SFT record ({shape}); write {{\"prompt\": ..., \"completion\": ...}} or "
                         f"{{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} per line")
    return json.dumps(record, ensure_ascii=False, sort_keys=True)


def _is_text_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _parquet(path: str, field: str, flag: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{flag} file {path} is not a readable parquet file ({e}); leave it out of {flag}") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ValueError(
            f"{flag} file {path} has no column {field!r} (its columns: {', '.join(map(repr, schema.names))}); "
            f"name the text column with {FIELD_FLAG}"
        )
    if not _is_text_type(schema.field(field).type):
        raise ValueError(
            f"{flag} file {path}: column {field!r} holds {schema.field(field).type}, not strings; "
            f"name a text column with {FIELD_FLAG}"
        )
    return pf


@dataclasses.dataclass
class _FileIndex:
    loc: array.array  # jsonl: byte offset of the line; parquet: row; text: 0
    line: array.array  # jsonl: line number (from 1); else 0
    digest: array.array
    empty: int = 0
    row_groups: np.ndarray | None = None  # parquet: first row of each row group, and the row count
    replaced: int = 0  # invalid UTF-8 sequences read as U+FFFD (text and jsonl files)

    def add(self, text: str | None, loc: int = 0, line: int = 0) -> None:
        if _blank(text):
            self.empty += 1
        else:
            self.loc.append(loc), self.line.append(line), self.digest.append(digest(text))


def _index_file(f: SourceFile, field: str, flag: str, sft: bool = False) -> _FileIndex:
    out = _FileIndex(array.array("q"), array.array("I"), array.array("Q"))
    if f.format == "text":
        raw = pathlib.Path(f.path).read_bytes()  # read once: counted, then decoded
        out.replaced += not_utf8(raw)
        out.add(_text(raw))
    elif f.format == "jsonl":
        offset = 0
        with open(f.path, "rb") as fh:
            for n, raw in enumerate(fh, start=1):
                if raw.strip():
                    out.replaced += not_utf8(raw)
                    where = f"line {n} of {flag} file {f.path}"
                    out.add(_sft_record(raw, where, flag) if sft else _jsonl_text(raw, field, where, flag), offset, n)
                offset += len(raw)
    else:
        import pyarrow as pa

        pf = _parquet(f.path, field, flag)
        rows = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        out.row_groups = np.cumsum([0] + rows, dtype=np.int64)
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[field]):
                for value in batch.column(0).to_pylist():
                    out.add(value, row)
                    row += 1
        except pa.ArrowException as e:  # a damaged page or column chunk
            raise ValueError(
                f"{flag} file {f.path} cannot be read after row {row} ({e}); leave it out of {flag}"
            ) from None
    return out


class Index:
    """The non-empty documents of some files, in order, as numpy arrays (see the module doc)."""

    def __init__(self, sources: tuple[str, ...], files: tuple[SourceFile, ...], parts: list[_FileIndex], field: str,
                 sft: bool = False):
        self.sources, self.files, self.field, self.sft = sources, files, field, sft
        counts = [len(p.digest) for p in parts]
        self.starts = np.cumsum([0] + counts, dtype=np.int64)  # documents of file i: starts[i]:starts[i + 1]
        self.loc = np.concatenate([np.frombuffer(p.loc, np.int64) for p in parts] or [np.zeros(0, np.int64)])
        self.line = np.concatenate([np.frombuffer(p.line, f"u{p.line.itemsize}") for p in parts]
                                   or [np.zeros(0, np.uint32)])
        self.digest = np.concatenate([np.frombuffer(p.digest, np.uint64) for p in parts] or [np.zeros(0, np.uint64)])
        self.empty_per_file = np.array([p.empty for p in parts], np.int64)
        self.replaced_per_file = np.array([p.replaced for p in parts], np.int64)
        self._row_groups = {i: p.row_groups for i, p in enumerate(parts) if p.row_groups is not None}

    def __len__(self) -> int:
        return len(self.digest)

    @property
    def empty(self) -> int:
        return int(self.empty_per_file.sum())

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def replaced(self) -> tuple[int, int]:
        """``(invalid UTF-8 sequences read as U+FFFD, files holding them)``."""
        return int(self.replaced_per_file.sum()), int((self.replaced_per_file > 0).sum())

    def _file(self, doc: int) -> int:
        return int(np.searchsorted(self.starts, doc, side="right")) - 1

    def key(self, doc: int) -> str:
        """A readable name: the file's name, plus ``:line`` (jsonl) or ``:row`` (parquet, from 0)."""
        f = self.files[self._file(doc)]
        if f.format == "text":
            return f.name
        return f"{f.name}:{self.line[doc] if f.format == 'jsonl' else self.loc[doc]}"

    def where(self, doc: int, flag: str = "--data") -> str:
        """The document for an error message: ``line N of --data file PATH`` (jsonl), else the file."""
        f = self.files[self._file(doc)]
        return f"line {self.line[doc]} of {flag} file {f.path}" if f.format == "jsonl" else f"{flag} file {f.path}"

    def text(self, doc: int) -> str:
        i = self._file(doc)
        f, loc = self.files[i], int(self.loc[doc])
        if f.format == "text":
            return _text(pathlib.Path(f.path).read_bytes())
        if f.format == "jsonl":
            with open(f.path, "rb") as fh:
                fh.seek(loc)
                raw = fh.readline()
            if self.sft:  # the record itself, as canonical JSON
                return _sft_record(raw, f"line {self.line[doc]} of {f.path}")
            return clean_text(_jsonl_text(raw, self.field, f"line {self.line[doc]} of {f.path}") or "")
        groups = self._row_groups[i]
        g = int(np.searchsorted(groups, loc, side="right")) - 1
        return clean_text(_parquet_column(f.path, g, self.field)[loc - int(groups[g])].as_py() or "")

    def source_docs(self, source: int) -> np.ndarray:
        """Document numbers of the given path ``source``, in order."""
        return np.concatenate(
            [np.arange(self.starts[i], self.starts[i + 1]) for i, f in enumerate(self.files) if f.source == source]
            or [np.zeros(0, np.int64)]
        )

    def describe(self, builtin: bool) -> list[dict]:
        """Per given path: resolved path, kind, files, bytes, documents and a fingerprint of their texts."""
        out = []
        for s, path in enumerate(self.sources):
            files = [f for f in self.files if f.source == s]
            docs = self.source_docs(s)
            kind = "builtin" if builtin else "directory" if pathlib.Path(path).is_dir() else "file"
            out.append(dict(path=path, kind=kind, files=len(files), bytes=sum(f.size for f in files),
                            documents=len(docs), fingerprint=fingerprint(self.digest[docs])))
        return out


@functools.lru_cache(maxsize=16)
def _parquet_column(path: str, group: int, field: str):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(group, columns=[field]).column(0)


_CACHE: OrderedDict = OrderedDict()  # (files, field) -> Index, for the few source sets a job reads (train, eval)


def build_index(paths: Sequence[str], *, field: str, flag: str, sft: bool = False) -> Index:
    """Read and check every document of ``paths`` once; errors name ``flag`` (``--data`` or ``--eval-data``).

    ``sft``: the documents are SFT records (``--data-format sft``, ``.jsonl`` only): each line's record is its text.
    Cached per process while no file changes (path, size, inode and mtime), so the trainer's check up front,
    the training iterator and each evaluation read the sources once.
    """
    if sft and not paths:
        raise ValueError(f"--data-format sft needs {flag} FILE.jsonl of SFT records (the built-in corpus is text)")
    sources, files = list_files(paths, flag)
    key = (sources, files, field, sft)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    for f in files if sft else ():
        if f.format != "jsonl":
            raise ValueError(f"{flag} file {f.path} is not .jsonl: --data-format sft reads .jsonl files of SFT records "
                             f"only; leave it out of {flag}")
    parts = []
    for f in files:
        try:
            parts.append(_index_file(f, field, flag, sft))
        except OSError as e:
            why = e.strerror or e
            raise ValueError(f"{flag} file {f.path} cannot be read ({why}); leave it out of {flag}") from None
    index = Index(sources, files, parts, field, sft)
    if paths:
        _check_not_empty(index, paths, flag)
    _CACHE[key] = index
    while len(_CACHE) > 4:
        _CACHE.popitem(last=False)
    return index


def _check_not_empty(index: Index, paths: Sequence[str], flag: str) -> None:
    for s, given in enumerate(paths):
        files = [i for i, f in enumerate(index.files) if f.source == s]
        if files and not sum(index.starts[i + 1] - index.starts[i] for i in files):
            empty = int(index.empty_per_file[files].sum())
            if not empty:  # not a document at all: no bytes, blank lines only, or a table without rows
                size = sum(index.files[i].size for i in files)
                what = ("has no rows" if all(index.files[i].format == "parquet" for i in files) else
                        "holds only blank lines" if size else "is empty (0 bytes)")
                use = "evaluate" if flag == "--eval-data" else "train"
                raise ValueError(f"{flag} {given} {what}: no document to {use} on; put documents in it, or leave it "
                                 f"out of {flag}")
            structured = any(index.files[i].format != "text" for i in files)
            fix = (f"name the field that holds the text with {FIELD_FLAG}, or leave it out of {flag}" if structured
                   else f"leave it out of {flag}")
            raise ValueError(f"{flag} {given} holds only empty documents ({empty} of them); {fix}")
