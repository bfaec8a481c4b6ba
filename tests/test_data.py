"""The data pipeline: packing, labels, order, resumable state, process shards, sources, tokenizers, sharding."""

import json
import pathlib
import re

import grain
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ulysses_jax import make_mesh
from ulysses_jax.data import (
    IGNORE,
    BatchIterator,
    ByteTokenizer,
    DataConfig,
    HFTokenizer,
    eval_batches,
    load_documents,
    make_tokenizer,
    pack_rows,
    stdlib_corpus_files,
    stdlib_root,
    to_global,
)

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
    loss = pytest.importorskip("ulysses_jax.loss")
    if not hasattr(loss, "shift_labels"):
        pytest.skip("ulysses_jax.loss.shift_labels has not landed yet")
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
    with pytest.raises(ValueError, match="saved with seq_len=64 but this iterator has seq_len=32"):
        other.set_state(state)


def test_processes_read_disjoint_documents(tmp_path, seed):
    cfg = write_corpus(tmp_path / "c.jsonl", 30, seed)
    seen = []
    for p in range(2):
        it = BatchIterator(cfg, seq_len=64, global_batch=4, seed=seed, process_index=p, process_count=2)
        ids = set()
        for _ in range(12):
            batch = next(it)
            assert batch["tokens"].shape == (2, 64)
            ids |= doc_ids(batch)
        seen.append(ids)
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(range(30))


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


# ---------------------------------------------------------------------------------------------- sources


def test_sources_txt_jsonl_parquet_and_directory(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("first text file\nwith two lines")
    (d / "sub" / "b.txt").write_bytes("caf\xe9 ".encode("latin-1"))  # not UTF-8: replaced, not an error
    (d / "c.jsonl").write_text('{"body": "json one"}\n\n{"body": "json two", "id": 2}\n')
    pq.write_table(pa.table({"body": ["pq one", "pq two", "pq three"]}), d / "d.parquet", row_group_size=2)
    (d / "notes.csv").write_text("ignored inside a directory")
    want = {
        "a.txt": "first text file\nwith two lines", "sub/b.txt": "caf\ufffd ", "c.jsonl:1": "json one",
        "c.jsonl:3": "json two", "d.parquet:0": "pq one", "d.parquet:1": "pq two", "d.parquet:2": "pq three",
    }  # fmt: skip
    cfg = DataConfig(paths=(str(d),), text_field="body", eval_fraction=0.0)
    assert dict(load_documents(cfg, "train")) == want
    files = DataConfig(paths=(str(d / "c.jsonl"), str(d / "sub" / "b.txt")), text_field="body", eval_fraction=0.0)
    want_files = {"c.jsonl:1": "json one", "c.jsonl:3": "json two", "b.txt": "caf\ufffd "}
    assert dict(load_documents(files, "train")) == want_files
    batch = next(single(cfg, seq_len=16, global_batch=2, seed=0))
    assert batch["tokens"].shape == (2, 16)


def test_stdlib_corpus(seed):
    files = stdlib_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.is_file() and "site-packages" not in f.parts for f in files)
    train, held = load_documents(DataConfig(), "train"), load_documents(DataConfig(), "eval")
    assert len(train) + len(held) == len(files) and len(held) > 0
    i = int(np.random.default_rng(seed).integers(len(train)))
    key, text = train[i]
    assert text == (stdlib_root() / key).read_bytes().decode("utf-8", "replace") and key.endswith(".py")
    assert not {k for k, _ in held} & {k for k, _ in train}
    batch = next(single(DataConfig(), seq_len=128, global_batch=2, seed=seed))
    assert batch["tokens"].shape == (2, 128) and np.count_nonzero(batch["segment_ids"]) > 0


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    sentences = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
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


def test_to_global_shards_batch_and_sequence(tmp_path, seed):
    cfg = write_corpus(tmp_path / "c.jsonl", 20, seed)
    local = next(single(cfg, seq_len=64, global_batch=4, seed=seed))
    mesh = make_mesh(fsdp=2, sp=4)
    arrays = to_global(local, mesh)
    assert set(arrays) == KEYS
    for key, arr in arrays.items():
        assert arr.shape == (4, 64) and arr.dtype == np.int32
        assert arr.sharding.spec == P(("data", "fsdp"), "sp")
        assert {s.data.shape for s in arr.addressable_shards} == {(2, 16)}
        np.testing.assert_array_equal(np.asarray(arr), local[key])
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by sp \(4\)"):
        to_global({"tokens": np.zeros((4, 30), np.int32)}, mesh)
    assert jax.process_count() == 1


# ---------------------------------------------------------------------------------------------- errors


def test_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "empty").mkdir()
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n' * 3)
    paths = lambda name: DataConfig(paths=(str(tmp_path / name),), eval_fraction=0.0)  # noqa: E731
    bad = {
        r"data path .*missing does not exist; pass existing files or directories": paths("missing"),
        r"data file .*x.csv has an unknown extension '.csv'": paths("x.csv"),
        r"no documents found in .*empty; pass files or directories": paths("empty"),
        r"eval_fraction=1.0 must be in \[0, 1\)": DataConfig(eval_fraction=1.0),
        r"the eval split is empty \(1 documents, eval_fraction=0.0\); raise --data.eval_fraction": paths("c.jsonl"),
    }  # fmt: skip
    for match, cfg in bad.items():
        with pytest.raises(ValueError, match=match):
            load_documents(cfg, "eval" if "eval split" in match else "train")
    with pytest.raises(ValueError, match=r"global_batch \(5\) must be divisible by the process count \(2\)"):
        BatchIterator(DataConfig(), seq_len=8, global_batch=5, seed=0, process_index=0, process_count=2)
    with pytest.raises(ValueError, match=r"tokenizer .*nope.json does not exist"):
        make_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"line 1 of .*c.jsonl has no field 'text'; name the text field"):
        next(single(paths("c.jsonl"), seq_len=8, global_batch=1, seed=0))
    with pytest.raises(ValueError, match=r"7 documents in a row have no tokens"):  # not an endless loop
        next(single(paths("blank.jsonl"), seq_len=8, global_batch=1, seed=0))
    with pytest.raises(ValueError, match=r"eval over 2 processes needs max_batches"):
        eval_batches(DataConfig(), seq_len=8, global_batch=2, process_index=0, process_count=2)
