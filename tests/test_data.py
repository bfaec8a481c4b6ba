"""The data pipeline: packing, labels, order, resumable state, process shards, the held-out split, sources, formats,
validation of bad inputs, tokenizers, sharding."""

import dataclasses
import json
import os
import pathlib
import re
import tracemalloc

import grain
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ulysses_jax import make_mesh
from ulysses_jax.data.documents import (
    IGNORE,
    DataConfig,
    describe_sources,
    load_documents,
    sources_differ,
    validate_sources,
)
from ulysses_jax.data.pipeline import BatchIterator, eval_batches, merge_states, pack_rows, process_rows, to_global
from ulysses_jax.data.sources import build_index, stdlib_corpus_files, stdlib_root
from ulysses_jax.data.tokenizers import ByteTokenizer, HFTokenizer, describe_tokenizer, make_tokenizer

KEYS = {"tokens", "labels", "segment_ids", "positions"}


def write_corpus(path: pathlib.Path, n: int, seed: int) -> DataConfig:
    """``n`` short jsonl documents ``"docNNN;" * k`` (shorter than 64 bytes: never cut at seq_len=64)."""
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"text": f"doc{i:03d};" * int(rng.integers(1, 8))}) + "\n" for i in range(n)))
    return DataConfig(paths=(str(path),), eval_fraction=0.0, pack_bins=4, shuffle_window=8, read_threads=1, prefetch=8)


def segments(row: dict) -> list[np.ndarray]:
    """The token pieces of one row, in segment order, checking each is contiguous with positions 0, 1, ..."""
    seg = row["segment_ids"]
    n_real = int(np.count_nonzero(seg))
    assert np.all(seg[:n_real] > 0) and np.all(seg[n_real:] == 0), "padding only at the row's end"
    assert np.all(row["tokens"][n_real:] == 0) and np.all(row["positions"][n_real:] == 0)
    out = []
    for s in range(1, seg.max() + 1):
        idx = np.flatnonzero(seg == s)
        assert len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))), "a segment is contiguous"
        np.testing.assert_array_equal(row["positions"][idx], np.arange(len(idx)))
        out.append(row["tokens"][idx])
    return out


def doc_ids(batch: dict) -> set[int]:
    byte = ByteTokenizer()
    ids = set()
    for b in range(batch["tokens"].shape[0]):
        for piece in segments({k: v[b] for k, v in batch.items()}):
            text = byte.decode(piece)
            assert re.fullmatch(r"(doc\d{3};)+", text) and len(set(text.split(";")[:-1])) == 1, text
            ids.add(int(text[3:6]))
    return ids


def single(cfg: DataConfig, **kw) -> BatchIterator:
    """The iterator of a one-process job."""
    return BatchIterator(cfg, process_index=0, process_count=1, **kw)


def rows_of(ds) -> list[dict]:
    return [dict(r) for r in ds]


def batches_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- packing, labels


def test_pack_rows_keeps_every_document_in_order(seed):
    rng = np.random.default_rng(seed)
    seq_len = 32
    lengths = rng.integers(1, 3 * seq_len, size=12).tolist() + [2 * seq_len + 5]  # the last one is cut in 3
    docs = [(1000 * (i + 1) + np.arange(n)).astype(np.int32) for i, n in enumerate(lengths)]
    rows = rows_of(pack_rows(grain.MapDataset.source(docs).to_iter_dataset(), seq_len, bins=4))
    pieces = {}
    for row in rows:
        assert set(row) == KEYS and all(v.shape == (seq_len,) and v.dtype == np.int32 for v in row.values())
        for piece in segments(row):
            assert 1 <= len(piece) <= seq_len
            pieces.setdefault(int(piece[0]) // 1000 - 1, []).append(piece)
    for i, doc in enumerate(docs):
        got = sorted(pieces[i], key=lambda p: int(p[0]))  # first-fit may place a document's pieces in any rows
        assert len(got) == -(-len(doc) // seq_len), "a document longer than seq_len is cut into seq_len pieces"
        np.testing.assert_array_equal(np.concatenate(got), doc)
    assert len(pieces[len(docs) - 1]) == 3


def test_labels_are_next_token_within_document(seed):
    seq_len, sp = 32, 4
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 256, size=n).astype(np.int32) for n in (40, 5, 9, 3, 14)]  # 40: a full row + 8
    for row in rows_of(pack_rows(grain.MapDataset.source(docs).to_iter_dataset(), seq_len, bins=2)):
        tok, seg, lab = row["tokens"], row["segment_ids"], row["labels"]
        for t in range(seq_len):
            same_doc = t + 1 < seq_len and seg[t] > 0 and seg[t + 1] == seg[t]
            assert lab[t] == (tok[t + 1] if same_doc else IGNORE), t
    full = rows_of(pack_rows(grain.MapDataset.source(docs[:1]).to_iter_dataset(), seq_len, bins=1))[0]
    b = seq_len // sp - 1  # last position of the first sp shard: its target is the next shard's first token
    assert full["segment_ids"][b] == full["segment_ids"][b + 1] == 1
    assert full["labels"][b] == full["tokens"][b + 1] == docs[0][b + 1] != IGNORE
    assert full["labels"][-1] == IGNORE  # the piece ends with the row


def test_labels_match_loss_shift_labels(seed):
    from ulysses_jax.model import loss

    assert loss.IGNORE == IGNORE
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 256, size=n).astype(np.int32) for n in (70, 11, 6, 20)]
    rows = rows_of(pack_rows(grain.MapDataset.source(docs).to_iter_dataset(), 32, bins=2))
    tokens, seg, labels = (np.stack([r[k] for r in rows]) for k in ("tokens", "segment_ids", "labels"))
    ref = np.asarray(loss.shift_labels(tokens, seg))
    # shift_labels does not look at padding (segment 0): compare on real tokens only.
    np.testing.assert_array_equal(labels[seg > 0], ref[seg > 0])


# ---------------------------------------------------------------------------------------------- the iterator


def test_same_seed_same_batches(tmp_path, seed):
    cfg = write_corpus(tmp_path / "c.jsonl", 40, seed)
    a, b, c = (single(cfg, seq_len=64, global_batch=4, seed=s) for s in (7, 7, 8))
    first = [next(a) for _ in range(3)]
    assert all(batches_equal(x, next(b)) for x in first)
    assert not all(batches_equal(x, next(c)) for x in first)
    assert set(first[0]) == KEYS and all(v.shape == (4, 64) and v.dtype == np.int32 for v in first[0].values())


@pytest.mark.parametrize("advance", [3, 11])  # inside the first shuffle window; after an epoch and several windows
def test_state_round_trip(tmp_path, seed, advance):
    cfg = write_corpus(tmp_path / "c.jsonl", 24, seed)
    it = single(cfg, seq_len=64, global_batch=4, seed=seed)
    for _ in range(advance):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(2)]
    resumed = single(cfg, seq_len=64, global_batch=4, seed=seed)
    resumed.set_state(state)
    assert all(batches_equal(x, next(resumed)) for x in expected)
    other = single(cfg, seq_len=32, global_batch=4, seed=seed)
    with pytest.raises(ValueError, match="saved with --seq-len 64 but this run has 32; resume with the same --seq-len"):
        other.set_state(state)


def test_processes_read_disjoint_documents(tmp_path, seed):
    """Within one pass over the documents, the rows (so the processes) of a batch read disjoint documents."""
    cfg = dataclasses.replace(write_corpus(tmp_path / "c.jsonl", 64, seed), shuffle=False)
    seen = []
    for p in range(2):
        it = BatchIterator(cfg, seq_len=64, global_batch=4, seed=seed, process_index=p, process_count=2)
        ids = set()
        for _ in range(3):  # at most one document per row here, and 16 per row in a pass
            batch = next(it)
            assert batch["tokens"].shape == (2, 64)
            ids |= doc_ids(batch)
        seen.append(ids)
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(range(64))


@pytest.mark.parametrize("counts", [(1, 2), (2, 1), (4, 2)])
def test_data_position_moves_to_another_number_of_processes(tmp_path, seed, counts):
    """The position is kept per global row: saved by P processes, resumed by Q, the same global batches follow."""
    cfg = write_corpus(tmp_path / "c.jsonl", 40, seed)
    a, b = counts

    def iterators(n):
        return [BatchIterator(cfg, seq_len=64, global_batch=4, seed=seed, process_index=p, process_count=n)
                for p in range(n)]

    def global_batch(its):
        parts = [next(it) for it in its]
        return {k: np.concatenate([x[k] for x in parts]) for k in parts[0]}

    first = iterators(a)
    for _ in range(5):
        global_batch(first)
    state = json.loads(json.dumps(merge_states([it.get_state() for it in first])))
    want = [global_batch(first) for _ in range(3)]
    second = iterators(b)
    for it in second:
        it.set_state(state)
    assert all(batches_equal(w, global_batch(second)) for w in want)
    assert sorted(state["rows"]) == ["0", "1", "2", "3"] and "process_index" not in state


def test_train_and_eval_are_disjoint_and_eval_is_one_finite_pass(tmp_path, seed):
    cfg = DataConfig(**{**write_corpus(tmp_path / "c.jsonl", 60, seed).__dict__, "eval_fraction": 0.3})
    train_keys = {k for k, _ in load_documents(cfg, "train")}
    eval_keys = {k for k, _ in load_documents(cfg, "eval")}
    assert train_keys and eval_keys and not train_keys & eval_keys and len(train_keys | eval_keys) == 60
    eval_ids = {int(k.rsplit(":", 1)[1]) - 1 for k in eval_keys}  # key "c.jsonl:<line>"
    passes = [list(eval_batches(cfg, seq_len=64, global_batch=4, process_index=0, process_count=1)) for _ in range(2)]
    assert len(passes[0]) == len(passes[1]) > 0 and all(map(batches_equal, *passes))
    assert all(b["tokens"].shape == (4, 64) for b in passes[0])  # the last batch is filled up with padding rows
    assert set().union(*map(doc_ids, passes[0])) == eval_ids
    one = eval_batches(cfg, seq_len=64, global_batch=4, max_batches=1, process_index=0, process_count=1)
    assert len(list(one)) == 1
    # Two processes: the same number of batches each, padded with all-IGNORE rows where one runs out.
    n = len(eval_keys) + 1  # more than either process needs (a process packs at most one document per row here)
    for p in range(2):
        got = list(eval_batches(cfg, seq_len=64, global_batch=4, max_batches=n, process_index=p, process_count=2))
        assert len(got) == n and np.all(got[-1]["labels"] == IGNORE) and got[0]["tokens"].shape == (2, 64)


# ---------------------------------------------------------------------------------------------- the held-out split


def texts(ds) -> set[str]:
    return {text for _, text in ds}


def test_held_out_split_does_not_depend_on_how_a_path_is_written(tmp_path, monkeypatch, seed):
    """Train on ``--data dir/``, evaluate on ``--data dir/sub/a.jsonl`` (the same file): no eval text was trained on."""
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    write_corpus(tmp_path / "dir" / "sub" / "a.jsonl", 45, seed)
    (tmp_path / "dir" / "b.md").write_text("doc999;" * 3)
    monkeypatch.chdir(tmp_path)
    base = dict(eval_fraction=0.3, pack_bins=4, shuffle_window=8, read_threads=1, prefetch=8)
    whole = DataConfig(paths=("dir/",), **base)
    spellings = [("dir/sub/a.jsonl",), ("./dir/sub/../sub/a.jsonl",), (str(tmp_path / "dir" / "sub" / "a.jsonl"),)]
    trained = texts(load_documents(whole, "train"))
    a_texts = {json.loads(x)["text"] for x in (tmp_path / "dir" / "sub" / "a.jsonl").read_text().splitlines()}
    held = texts(load_documents(whole, "eval")) & a_texts
    assert held and trained & a_texts and held | (trained & a_texts) == a_texts
    for paths in spellings:
        one = DataConfig(paths=paths, **base)
        assert texts(load_documents(one, "eval")) == held, paths
        assert not texts(load_documents(one, "eval")) & trained
    # Through the iterators: what eval reads of the single file never occurs in training on the directory.
    one = DataConfig(paths=spellings[0], **base)
    eval_ids = set().union(*map(doc_ids, eval_batches(one, seq_len=64, global_batch=4, process_index=0,
                                                       process_count=1)))
    train_it, seen = single(whole, seq_len=64, global_batch=4, seed=seed), set()
    for _ in range(20):  # about two epochs of the 32 training documents
        seen |= doc_ids(next(train_it)) - {999}
    assert eval_ids and len(seen) == 45 - len(eval_ids) and not eval_ids & seen


def test_a_text_that_occurs_twice_is_on_one_side(tmp_path, seed):
    rng = np.random.default_rng(seed)
    texts_ = [f"doc{i:03d};" * 3 for i in range(40)]
    lines = [texts_[i] for i in rng.integers(0, 40, size=120)]  # many repeats, in several files and formats
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:80]))
    for i, t in enumerate(lines[80:]):
        (tmp_path / f"t{i:02d}.txt").write_text(t)
    cfg = DataConfig(paths=(str(tmp_path),), eval_fraction=0.4)
    train, held = texts(load_documents(cfg, "train")), texts(load_documents(cfg, "eval"))
    assert train and held and not train & held and train | held == set(lines)


def test_eval_data_is_the_eval_split(tmp_path, seed):
    cfg = write_corpus(tmp_path / "train.jsonl", 40, seed)
    val = tmp_path / "val"
    val.mkdir()
    (val / "v.jsonl").write_text("".join(json.dumps({"text": f"doc{i:03d};" * 2}) + "\n" for i in range(500, 509)))
    (val / "w.txt").write_text("doc509;")
    with_val = dataclasses.replace(cfg, eval_paths=(str(val),), eval_fraction=0.3)
    assert dict(load_documents(with_val, "eval")) == {
        **{f"v.jsonl:{i + 1}": f"doc{500 + i:03d};" * 2 for i in range(9)}, "w.txt": "doc509;"}
    no_val = dataclasses.replace(with_val, eval_paths=())
    # training still leaves out its held-out fraction; "held_out" reads it either way
    assert texts(load_documents(with_val, "train")) == texts(load_documents(no_val, "train"))
    assert texts(load_documents(with_val, "held_out")) == texts(load_documents(no_val, "eval"))
    everything = dataclasses.replace(with_val, eval_fraction=0.0)
    assert len(load_documents(everything, "train")) == 40
    got = list(eval_batches(with_val, seq_len=64, global_batch=4, process_index=0, process_count=1))
    assert set().union(*map(doc_ids, got)) == set(range(500, 510))
    held = list(eval_batches(with_val, seq_len=64, global_batch=4, process_index=0, process_count=1, split="held_out"))
    assert set().union(*map(doc_ids, held)) < set(range(40))
    # a validation text that also occurs in the training split is counted, not silently used
    (val / "dup.jsonl").write_text(json.dumps({"text": texts(load_documents(everything, "train")).pop()}) + "\n")
    summary = validate_sources(everything)
    assert summary.eval_overlap == 1 and summary.eval_documents == 11 and summary.eval_files == 3
    assert summary.train_documents == summary.documents == 40


# ---------------------------------------------------------------------------------------------- sources


def test_sources_txt_jsonl_parquet_and_directory(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    (d / "a.txt").write_text("first text file\nwith two lines")
    (d / "sub" / "b.txt").write_bytes("caf\xe9 ".encode("latin-1"))  # not UTF-8: replaced, not an error
    (d / "sub" / "e.md").write_text("# a markdown file")
    (d / "sub" / "blank.md").write_text(" \n\n")  # empty: skipped
    (d / "c.jsonl").write_text('{"body": "json one"}\n\n{"body": "json two", "id": 2}\n{"body": null}\n')
    pq.write_table(pa.table({"body": ["pq one", None, "pq three", ""]}), d / "d.parquet", row_group_size=2)
    (d / "notes.csv").write_text("ignored inside a directory")
    (d / ".hidden" / "x.txt").write_text("hidden: skipped")
    want = {
        "a.txt": "first text file\nwith two lines", "sub/b.txt": "caf\ufffd ", "sub/e.md": "# a markdown file",
        "c.jsonl:1": "json one", "c.jsonl:3": "json two", "d.parquet:0": "pq one", "d.parquet:2": "pq three",
    }  # fmt: skip
    cfg = DataConfig(paths=(str(d),), text_field="body", eval_fraction=0.0)
    assert dict(load_documents(cfg, "train")) == want
    summary = validate_sources(cfg)
    assert (summary.files, summary.documents, summary.empty, summary.eval_documents) == (6, 7, 4, 0)
    assert summary.bytes == sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and ".hidden" not in f.parts
                                and f.suffix != ".csv")
    files = DataConfig(paths=(str(d / "c.jsonl"), str(d / "sub" / "b.txt"), str(d)), text_field="body",
                       eval_fraction=0.0)  # c.jsonl and b.txt named twice: read once
    want_files = {"c.jsonl:1": "json one", "c.jsonl:3": "json two", "b.txt": "caf\ufffd "}
    assert list(load_documents(files, "train"))[:3] == list(want_files.items())
    assert len(load_documents(files, "train")) == len(want)
    batch = next(single(cfg, seq_len=16, global_batch=2, seed=0))
    assert batch["tokens"].shape == (2, 16)


def test_utf8_with_or_without_bom(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    bom = "\ufeff"
    (tmp_path / "a.txt").write_text(bom + "text with a BOM", encoding="utf-8")
    (tmp_path / "b.txt").write_text("text with a BOM", encoding="utf-8")  # the same document: one hash
    (tmp_path / "c.jsonl").write_text(
        bom + json.dumps({"text": "first line"}) + "\n" + bom + json.dumps({"text": "second line"}) + "\n"
        + json.dumps({"text": bom + "value with a BOM"}) + "\n" + json.dumps({"text": "lone \ud800 surrogate"}) + "\n",
        encoding="utf-8",
    )
    pq.write_table(pa.table({"text": [bom + "parquet with a BOM", "plain"]}), tmp_path / "d.parquet")
    cfg = DataConfig(paths=(str(tmp_path),), eval_fraction=0.0)
    got = dict(load_documents(cfg, "train"))
    assert got == {
        "a.txt": "text with a BOM", "b.txt": "text with a BOM", "c.jsonl:1": "first line", "c.jsonl:2": "second line",
        "c.jsonl:3": "value with a BOM", "c.jsonl:4": "lone \ufffd surrogate", "d.parquet:0": "parquet with a BOM",
        "d.parquet:1": "plain",
    }  # fmt: skip
    index = build_index(cfg.paths, field="text", flag="--data")
    assert index.digest[0] == index.digest[1]  # a.txt and b.txt: the BOM is not part of the text
    hf = pytest.importorskip("tokenizers")
    tok = hf.Tokenizer(hf.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(bom + tok.to_str(), encoding="utf-8")  # a BOM here too
    batch = next(single(dataclasses.replace(cfg, tokenizer=str(tmp_path / "tok")), seq_len=8, global_batch=2, seed=0))
    assert batch["tokens"].shape == (2, 8)  # the lone surrogate reached the HF tokenizer as U+FFFD


def test_index_is_numpy_arrays_and_reading_streams(tmp_path):
    """A large jsonl costs about 20 bytes a line in the index, and no copy of the file while it is read."""
    n, width = 20_000, 500
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": f"{i:07d} " + "x" * width}) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = build_index((str(path),), field="text", flag="--data")
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == n and index.loc.dtype == np.int64 and index.digest.dtype == np.uint64
    assert index.key(n - 1) == f"big.jsonl:{n}" and index.text(n - 1).startswith(f"{n - 1:07d} ")
    assert held - base < 40 * n, f"the index holds {(held - base) / n:.0f} bytes per line"
    assert peak - base < size / 4, f"reading took {(peak - base) / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def test_describe_sources_is_canonical_and_detects_changes(tmp_path, monkeypatch, seed):
    d = tmp_path / "d"
    d.mkdir()
    write_corpus(d / "c.jsonl", 30, seed)
    (d / "n.txt").write_text("a note")
    monkeypatch.chdir(tmp_path)
    rec = describe_sources(DataConfig(paths=("d",)))
    assert json.loads(json.dumps(rec)) == rec and len(rec) == 1
    assert rec[0] | {"fingerprint": None} == dict(role="train", path=str(d.resolve()), kind="directory", files=2,
                                                 bytes=(d / "c.jsonl").stat().st_size + 6, documents=31,
                                                 fingerprint=None)
    assert sources_differ(rec, describe_sources(DataConfig(paths=(str(d) + "/",)))) is None
    assert sources_differ(rec, describe_sources(DataConfig(paths=("./d/../d",), tokenizer=None))) is None
    one = describe_sources(DataConfig(paths=("d/c.jsonl",), eval_paths=("d/n.txt",)))
    assert [(x["role"], x["kind"], x["documents"]) for x in one] == [("train", "file", 30), ("eval", "file", 1)]
    assert "is not the run's" in sources_differ(rec, one)
    assert "--eval-data" in sources_differ(one[:1] + [dict(one[1], fingerprint="0" * 32)], one)
    (d / "n.txt").write_text("a changed note, longer")
    why = sources_differ(rec, describe_sources(DataConfig(paths=("d",))))
    assert why.startswith(f"--data {d.resolve()} has changed since the run (31 documents")
    builtin = describe_sources(DataConfig())
    assert builtin[0]["kind"] == "builtin" and builtin[0]["path"] == str(stdlib_root().resolve())


def test_resume_refuses_other_data(tmp_path, seed):
    cfg = write_corpus(tmp_path / "c.jsonl", 24, seed)
    it = single(cfg, seq_len=64, global_batch=4, seed=seed)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    lines[3] = json.dumps({"text": "doc003;" * 9})  # one document edited: as many documents, other text
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    edited = single(cfg, seq_len=64, global_batch=4, seed=seed)
    with pytest.raises(ValueError, match=r"saved with training data fingerprint '\w+' but this run has '\w+'; "
                                         r"resume with the same --data, --data-field and --eval-fraction"):
        edited.set_state(state)


def test_stdlib_corpus(seed):
    files = stdlib_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.is_file() and "site-packages" not in f.parts for f in files)
    train, held = load_documents(DataConfig(), "train"), load_documents(DataConfig(), "eval")
    empty = sum(1 for f in files if not f.read_bytes().strip())  # empty __init__.py files are skipped
    assert len(train) + len(held) == len(files) - empty and len(held) > 0 and empty
    i = int(np.random.default_rng(seed).integers(len(train)))
    key, text = train[i]
    assert text == (stdlib_root() / key).read_bytes().decode("utf-8", "replace") and key.endswith(".py")
    assert not {k for k, _ in held} & {k for k, _ in train}
    batch = next(single(DataConfig(), seq_len=128, global_batch=2, seed=seed))
    assert batch["tokens"].shape == (2, 128) and np.count_nonzero(batch["segment_ids"]) > 0


def save_word_tokenizer(path: pathlib.Path, sentences: list[str]):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def test_hf_tokenizer(tmp_path):
    sentences = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"]
    tok = save_word_tokenizer(tmp_path / "tokenizer.json", sentences)
    hf = make_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == tok.get_vocab_size() == 10
    ids = hf.encode("the dog sat on the mat")
    assert ids.dtype == np.int32 and len(ids) == 6 and hf.decode(ids) == "the dog sat on the mat"
    assert hf.encode("the bird")[1] == tok.token_to_id("[UNK]")
    corpus = tmp_path / "s.jsonl"
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    cfg = DataConfig(paths=(str(corpus),), tokenizer=str(tmp_path / "tokenizer.json"), eval_fraction=0.0)
    it = single(cfg, seq_len=8, global_batch=2, seed=0)
    batch = next(it)
    assert it.vocab_size == 10 and batch["tokens"].max() < 10
    assert validate_sources(cfg).vocab_size == 10
    desc = describe_tokenizer(str(tmp_path))
    assert desc["path"] == str((tmp_path / "tokenizer.json").resolve()) and desc["vocab_size"] == 10
    assert desc == describe_tokenizer(str(tmp_path / "tokenizer.json")) and len(desc["fingerprint"]) == 32
    assert describe_tokenizer(None)["vocab_size"] == 256


def test_to_global_shards_batch_and_sequence(tmp_path, seed):
    cfg = write_corpus(tmp_path / "c.jsonl", 20, seed)
    local = next(single(cfg, seq_len=64, global_batch=4, seed=seed))
    mesh = make_mesh(fsdp=2, sp=4)
    arrays = to_global(local, mesh)
    assert set(arrays) == KEYS
    for key, arr in arrays.items():
        assert arr.shape == (4, 64) and arr.dtype == np.int32
        assert arr.sharding.spec == P(("data", "fsdp"), ("ring", "sp"))
        assert {s.data.shape for s in arr.addressable_shards} == {(2, 16)}
        np.testing.assert_array_equal(np.asarray(arr), local[key])
    with pytest.raises(ValueError, match=r"--seq-len \(30\) must be divisible by --mesh.sp \(4\)"):
        to_global({"tokens": np.zeros((4, 30), np.int32)}, mesh)
    with pytest.raises(ValueError, match=r"--batch-size \(3\) must be divisible by --mesh.data x --mesh.fsdp \(2\)"):
        to_global({"tokens": np.zeros((3, 32), np.int32)}, mesh)
    assert jax.process_count() == 1


def test_rows_by_devices_give_each_device_its_part(tmp_path, seed):
    """process_rows: the global rows this process's devices hold (all of them on one process); to_global with row_ids
    builds the same arrays from any subset order, each device's part cut from the rows it holds."""
    cfg = write_corpus(tmp_path / "c.jsonl", 20, seed)
    mesh = make_mesh(fsdp=2, ring=2, sp=2)
    rows = process_rows(mesh, 4, 64)
    assert rows == (0, 1, 2, 3)
    it = single(cfg, seq_len=64, global_batch=4, seed=seed)
    local = next(BatchIterator(cfg, seq_len=64, global_batch=4, seed=seed, process_index=0, process_count=1,
                               row_ids=rows))
    np.testing.assert_array_equal(local["tokens"], next(it)["tokens"])
    backwards = {k: v[::-1] for k, v in local.items()}
    for batch, ids in ((local, rows), (backwards, rows[::-1])):
        arrays = to_global(batch, mesh, global_batch=4, row_ids=ids)
        for key, arr in arrays.items():
            assert arr.sharding.spec == P(("data", "fsdp"), ("ring", "sp"))
            np.testing.assert_array_equal(np.asarray(arr), local[key])
    with pytest.raises(ValueError, match=r"row_ids \[4\] must be rows of the global batch of 4"):
        BatchIterator(cfg, seq_len=64, global_batch=4, seed=seed, process_index=0, process_count=1, row_ids=[4])


# ---------------------------------------------------------------------------------------------- bad inputs


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


SENTENCEPIECE = b"\x0a\x0b\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02"  # the start of a sentencepiece ModelProto

# name: ({file name: content}, DataConfig fields (paths under tmp_path), need_eval, message regex)
BAD = {
    "missing path": ({}, dict(paths=("nope",)), False, r"--data .*nope does not exist; pass existing files"),
    "missing eval path": ({"a.txt": "x"}, dict(paths=("a.txt",), eval_paths=("nope",)), False,
                          r"--eval-data .*nope does not exist; pass existing files or directories with --eval-data"),
    "unknown extension": ({"x.csv": "a,b"}, dict(paths=("x.csv",)), False,
                          r"--data .*x.csv has an unknown extension '.csv'; pass .txt .md .markdown .py .jsonl "
                          r".parquet files \(one JSON object per line: .jsonl\) with --data"),
    "directory without documents": ({"d/x.csv": "a,b", "d/.h.txt": "hidden"}, dict(paths=("d",)), False,
                                    r"--data .*d: the directory holds no .txt .md .markdown .py .jsonl .parquet files"),
    "malformed line": ({"c.jsonl": jsonl({"text": "ok"}, '{"text": "x",}')}, dict(paths=("c.jsonl",)), False,
                       r"line 2 of --data file .*c.jsonl is not valid JSON \(.+ at column 1\d\); fix it \(one JSON "
                       r"object per line\) or leave the file out of --data"),
    "unterminated string": ({"c.jsonl": '{"text": "ok"}\n{"text": "x}\n'}, dict(paths=("c.jsonl",)), False,
                            r"line 2 of --data file .*c.jsonl is not valid JSON \(Unterminated string starting at "
                            r"column 10\); fix it"),
    "line not an object": ({"c.jsonl": jsonl(["text", "x"])}, dict(paths=("c.jsonl",)), False,
                           r"line 1 of --data file .*c.jsonl is a JSON array, not an object; write one JSON object "
                           r"per line with the text under 'text'"),
    "missing field": ({"c.jsonl": jsonl({"body": "x", "id": 1})}, dict(paths=("c.jsonl",)), False,
                      r"line 1 of --data file .*c.jsonl has no field 'text' \(its fields: 'body', 'id'\); "
                      r"name the text field with --data-field"),
    "non-string field": ({"c.jsonl": jsonl({"text": "x"}, {"text": 12})}, dict(paths=("c.jsonl",)), False,
                         r"field 'text' in line 2 of --data file .*c.jsonl is a JSON number, not a string; "
                         r"name a text field with --data-field"),
    "only empty documents": ({"c.jsonl": jsonl({"text": ""}, {"text": " \n"}, {"text": None})},
                             dict(paths=("c.jsonl",)), False,
                             r"--data c.jsonl holds only empty documents \(3 of them\); name the field that holds "
                             r"the text with --data-field, or leave it out of --data"),
    "only empty text files": ({"d/a.txt": "", "d/b.md": "\n"}, dict(paths=("d",)), False,
                              r"--data d holds only empty documents \(2 of them\); leave it out of --data"),
    "malformed eval line": ({"a.txt": "x", "v.jsonl": "{\n"}, dict(paths=("a.txt",), eval_paths=("v.jsonl",)),
                            False, r"line 1 of --eval-data file .*v.jsonl is not valid JSON .* out of --eval-data"),
    "not parquet": ({"p.parquet": "not parquet"}, dict(paths=("p.parquet",)), False,
                    r"--data file .*p.parquet is not a readable parquet file \(.*\); leave it out of --data"),
    "parquet column missing": ("parquet:body", dict(paths=("p.parquet",)), False,
                               r"--data file .*p.parquet has no column 'text' \(its columns: 'body', 'n'\); "
                               r"name the text column with --data-field"),
    "parquet column not text": ("parquet:body", dict(paths=("p.parquet",), text_field="n"), False,
                                r"--data file .*p.parquet: column 'n' holds int64, not strings; name a text column "
                                r"with --data-field"),
    "eval fraction": ({"a.txt": "x"}, dict(paths=("a.txt",), eval_fraction=1.0), False,
                      r"--eval-fraction 1.0 must be in \[0, 1\); e.g. 0.02 holds out 2% of documents"),
    "empty field name": ({"a.txt": "x"}, dict(paths=("a.txt",), text_field=""), False,
                         r"--data-field '' must name the text field of .jsonl/.parquet data"),
    "paths as a string": ({"a.txt": "x"}, dict(paths="a.txt"), False, r"--data takes a list of paths, not 'a.txt'"),
    "nothing held out": ({"a.txt": "x"}, dict(paths=("a.txt",), eval_fraction=0.0), True,
                         r"none of the 1 documents is held out \(--eval-fraction 0.0\); raise --eval-fraction, add "
                         r"documents with --data, or give a validation source with --eval-data"),
    "tokenizer missing": ({"a.txt": "x"}, dict(paths=("a.txt",), tokenizer="nope.json"), False,
                          r"--tokenizer nope.json does not exist; pass a Hugging Face tokenizer.json with --tokenizer"),
    "sentencepiece file": ({"a.txt": "x", "m/tokenizer.model": SENTENCEPIECE},
                           dict(paths=("a.txt",), tokenizer="m/tokenizer.model"), False,
                           r"--tokenizer .*tokenizer.model is a sentencepiece model; a Hugging Face tokenizer.json is "
                           r"needed: convert it .* and pass that with --tokenizer"),
    "sentencepiece directory": ({"a.txt": "x", "m/tokenizer.model": SENTENCEPIECE},
                                dict(paths=("a.txt",), tokenizer="m"), False,
                                r"--tokenizer m holds a sentencepiece tokenizer.model; a Hugging Face tokenizer.json"),
    "tokenizer directory without one": ({"a.txt": "x", "m/config.json": "{}"}, dict(paths=("a.txt",), tokenizer="m"),
                                        False, r"--tokenizer m is a directory without a tokenizer.json"),
    "tokenizer not JSON": ({"a.txt": "x", "t.json": "vocab: 1"}, dict(paths=("a.txt",), tokenizer="t.json"), False,
                           r"--tokenizer .*t.json is not a Hugging Face tokenizer.json \(.*\); pass the tokenizer"),
    "tokenizer other JSON": ({"a.txt": "x", "t.json": '{"vocab_size": 10}'},
                             dict(paths=("a.txt",), tokenizer="t.json"), False,
                             r"--tokenizer .*t.json is not a Hugging Face tokenizer.json \(.*\); pass the tokenizer"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_naming_the_flag(tmp_path, monkeypatch, name):
    files, fields, need_eval, match = BAD[name]
    monkeypatch.chdir(tmp_path)
    if files == "parquet:body":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"body": ["x"], "n": [1]}), "p.parquet")
        files = {}
    for rel, content in files.items():
        pathlib.Path(rel).parent.mkdir(parents=True, exist_ok=True)
        (pathlib.Path(rel).write_bytes if isinstance(content, bytes) else pathlib.Path(rel).write_text)(content)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=match) as err:
        validate_sources(DataConfig(**fields), need_eval=need_eval)
    assert "\n" not in str(err.value) and sorted(tmp_path.rglob("*")) == before  # one line, nothing written


def test_unreadable_files(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "tokenizer.json").write_text("{}")
    if os.geteuid() == 0:  # root reads any file: refuse these two the way the system would for another user
        import builtins

        locked, real_open, real_read = {"a.txt", "tokenizer.json"}, builtins.open, pathlib.Path.read_bytes

        def deny(path):
            if pathlib.Path(path).name in locked:
                raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(builtins, "open", lambda f, *a, **k: deny(f) or real_open(f, *a, **k))
        monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: deny(self) or real_read(self))
    else:
        for f in tmp_path.iterdir():
            f.chmod(0)
    with pytest.raises(ValueError, match=r"--data file .*a.txt cannot be read \(Permission denied\); leave it out"):
        validate_sources(DataConfig(paths=(str(tmp_path / "a.txt"),)))
    with pytest.raises(ValueError, match=r"--tokenizer .*tokenizer.json cannot be read \(Permission denied\)"):
        make_tokenizer(str(tmp_path / "tokenizer.json"))


def test_iterator_errors(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"--batch-size \(5\) must be divisible by the number of processes \(2\)"):
        BatchIterator(DataConfig(), seq_len=8, global_batch=5, seed=0, process_index=0, process_count=2)
    one_doc = DataConfig(paths=(str(tmp_path / "c.jsonl"),), eval_fraction=0.0)  # fewer documents than rows: repeated
    assert next(BatchIterator(one_doc, seq_len=8, global_batch=2, seed=0, process_index=1, process_count=2))[
        "tokens"].shape == (1, 8)
    with pytest.raises(ValueError, match=r"eval over 2 processes needs a batch limit \(--max-batches N\)"):
        eval_batches(DataConfig(), seq_len=8, global_batch=2, process_index=0, process_count=2)


def test_tokenless_documents_do_not_loop_forever(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.normalizer = tokenizers.normalizers.Replace("x", "")  # every document is "x ...": no token survives
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.jsonl").write_text(jsonl({"text": "x"}, {"text": "xx x"}, {"text": "x x"}))
    cfg = DataConfig(paths=(str(tmp_path / "c.jsonl"),), tokenizer=str(tmp_path / "tokenizer.json"), eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"7 documents in a row have no tokens; check --tokenizer"):
        next(single(cfg, seq_len=8, global_batch=1, seed=0))


def test_an_empty_source_is_named_by_its_flag_and_kind(tmp_path):
    """A parquet file without rows was said to hold "only blank lines"; an empty --eval-data of `eval` was named
    --data, "no document to train on" (both found by a review)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "zero.parquet")
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"^--data .*zero.parquet has no rows: no document to train on"):
        validate_sources(DataConfig(paths=(str(tmp_path / "zero.parquet"),)))
    with pytest.raises(ValueError, match=r"^--eval-data .*e.jsonl is empty \(0 bytes\): no document to evaluate on; "
                                         r"put documents in it, or leave it out of --eval-data"):
        validate_sources(DataConfig(paths=(str(tmp_path / "a.txt"),), eval_paths=(str(tmp_path / "e.jsonl"),)))
