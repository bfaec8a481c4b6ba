"""`train --eval-by-position --eval-passkey` and `eval --by-position --task passkey` as users run them: the metrics,
both JSONs and both PNGs, and every bad input as one line with exit 2 and nothing written."""

import json
import os
import pathlib

import pytest

from ulysses_jax.cli import main
from ulysses_jax.evaluation.passkey_eval import parse_list

TINY = ["--preset", "tiny", "--seq-len", "256", "--attention", "xla", "--no-progress", "--mesh.fsdp", "2",
        "--mesh.sp", "4"]
PNG = b"\x89PNG\r\n\x1a\n"


def snapshot(path: pathlib.Path):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("tasks") / "run"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-every", "1", "--eval-every", "1", "--eval-batches", "1",
                 "--eval-by-position", "--eval-passkey", "--eval-passkey-samples", "1", "--run-dir", str(run)]) == 0
    return run


def test_loop_logs_buckets_and_passkey(run):
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["eval_loss"] > 0 and r["eval_loss_pos_0_1"] > 0 and r["eval_loss_pos_128_256"] > 0
        assert 0.0 <= r["eval_passkey_accuracy"] <= 1.0 and "eval_passkey_depth_0.5" in r


def test_eval_writes_both_jsons_and_plots(run, capsys):
    assert main(["eval", "--run-dir", str(run), "--by-position", "--task", "passkey", "--steps", "1,last",
                 "--max-batches", "1", "--samples", "2", "--lengths", "128,256", "--depths", "0,0.5,1"]) == 0
    out = capsys.readouterr().out
    assert "by position:" in out and "eval_passkey.png" in out
    # the terminal names the mesh (the run's own shape here: 8 devices, fsdp 2 x sp 4) and sums up each task
    assert "Mesh: fsdp 2 x sp 4 (the run trained on fsdp 2 x sp 4); memory pool 95% of each GPU (the run's" in out
    assert "  by position: loss " in out and "  passkey at step 2: " in out and " of 12 samples right (" in out
    pos = json.loads((run / "eval_by_position.json").read_text())
    assert pos["step"] == 2 and [s["step"] for s in pos["steps"]] == [1, 2]
    assert set(pos["buckets"][0]) == {"start", "end", "tokens", "loss"}
    weighted = sum(b["tokens"] * b["loss"] for b in pos["buckets"] if b["tokens"]) / pos["tokens"]
    assert weighted == pytest.approx(pos["loss"], rel=1e-13)
    last_eval = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert last_eval["step"] == 2 and last_eval["loss"] == pytest.approx(pos["loss"], rel=1e-5)
    pk = json.loads((run / "eval_passkey.json").read_text())
    # --steps 1,last scores every step: each entry names its checkpoint; "step" (top level) is the last
    assert pk["step"] == 2
    assert [(r["step"], r["length"], r["depth"], r["samples"]) for r in pk["results"]] == [
        (s, n, d, 2) for s in (1, 2) for n in (128, 256) for d in (0.0, 0.5, 1.0)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in pk["results"])
    for name in ("eval_by_position.png", "eval_passkey.png"):
        data = (run / name).read_bytes()
        assert data.startswith(PNG) and 5_000 < len(data) < 200_000


@pytest.mark.parametrize("args,message", [
    (["--task", "passkey", "--depths", "0,1.5"], r"--depths 1.5 must be in [0, 1]"),
    (["--task", "passkey", "--lengths", "1024"], "--lengths 1024 is over the run's --seq-len 256"),
    (["--task", "passkey", "--lengths", "40"], "--lengths 40 is too short for a passkey sample"),
    (["--task", "passkey", "--lengths", "4k"], "--lengths '4k' must be comma-separated integers"),
    (["--task", "passkey", "--samples", "0"], "--samples (0) must be at least 1"),
    (["--by-position", "--steps", "1,7"], "--steps 7: no such checkpoint"),  # named --step before (a trial)
    (["--by-position", "--steps", "first"], "'first' is neither a step number nor 'last'"),
    (["--task", "needle"], "Expected one of passkey"),
], ids=["depth", "too-long", "too-short", "not-a-number", "samples", "no-such-step", "bad-step", "task"])
def test_bad_input_one_line_exit_2_nothing_written(run, args, message, capsys):
    before = snapshot(run)
    assert main(["eval", "--run-dir", str(run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert snapshot(run) == before


def test_an_empty_eval_data_is_named_as_such(run, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")  # named --data before, "no document to train on" (found by a review)
    before = snapshot(run)
    assert main(["eval", "--run-dir", str(run), "--eval-data", str(tmp_path / "empty.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --eval-data {tmp_path / 'empty.jsonl'} is empty (0 bytes): no "
                                               f"document to evaluate on; put documents in it, or leave it out of "
                                               f"--eval-data")
    assert snapshot(run) == before


def test_no_checkpoint(tmp_path, capsys):
    assert main(["eval", "--run-dir", str(tmp_path / "none"), "--by-position", "--task", "passkey"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and not (tmp_path / "none").exists()


@pytest.mark.slow  # a second training run (~25 s on 2 cores); the digit check itself is in test_passkey.py
def test_tokenizer_without_digits(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["alpha beta gamma document"], tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "words.json"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("alpha beta gamma document " * 50)
    flags = [*TINY[:-4], "--seq-len", "64", "--tokenizer", str(tmp_path / "words.json"), "--data", str(corpus),
             "--eval-data", str(corpus), "--steps", "1", "--run-dir", str(tmp_path / "words")]
    assert main(["train", *flags, "--eval-every", "1", "--eval-passkey"]) == 2
    assert "cannot write digits" in capsys.readouterr().err and not (tmp_path / "words").exists()
    assert main(["train", *flags]) == 0
    before = snapshot(tmp_path / "words")
    assert main(["eval", "--run-dir", str(tmp_path / "words"), "--task", "passkey"]) == 2
    err = capsys.readouterr().err
    assert "cannot write digits ('0123456789' reads back as" in err and len(err.strip().splitlines()) == 1
    assert snapshot(tmp_path / "words") == before


def test_parse_list():
    assert parse_list("4096, 16384", "--lengths") == (4096, 16384)
    assert parse_list("0,0.25,1", "--depths", float) == (0.0, 0.25, 1.0)
    with pytest.raises(ValueError, match="--depths is empty"):
        parse_list(",", "--depths", float)


def test_outside_harness_reads_the_export_and_the_task(run, tmp_path, capsys):
    """What lm-evaluation-harness reads, checked without it and without network: the task YAML and its local JSON
    dataset, and the exported folder's config.json (its context length covers the run's) and weights."""
    yaml = pytest.importorskip("yaml")
    transformers = pytest.importorskip("transformers")
    assert main(["eval", "--run-dir", str(run), "--task", "passkey", "--lengths", "160,256", "--depths", "0,1",
                 "--samples", "2", "--max-batches", "1", "--no-plot", "--harness-task", str(tmp_path / "task")]) == 0
    assert "ulysses_passkey.yaml" in capsys.readouterr().out
    task = yaml.safe_load((tmp_path / "task" / "ulysses_passkey.yaml").read_text())
    assert task["task"] == "ulysses_passkey" and task["dataset_path"] == "json" and task["test_split"] == "test"
    assert task["output_type"] == "generate_until" and task["generation_kwargs"]["do_sample"] is False
    assert task["doc_to_text"] == "{{input}}" and task["doc_to_target"] == "{{answer}}"
    assert task["metric_list"][0]["metric"] == "exact_match"
    rows = [json.loads(x) for x in pathlib.Path(task["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
    assert [(r["length"], r["depth"]) for r in rows] == [(n, d) for n in (160, 256) for d in (0.0, 1.0) for _ in "ab"]
    for r in rows:
        assert r["answer"].isdigit() and len(r["answer"]) == 5 and r["answer"] in r["input"]
        assert r["input"].endswith("What is the pass key? The pass key is ")
        assert len(r["input"].encode()) == r["length"] - 1 - 5  # bytes: the sample less its key and "."
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.max_position_embeddings >= 256 and config.architectures
    assert list((tmp_path / "hf").glob("*.safetensors"))


def test_eval_runs_in_the_pool_the_run_trained_in(run, tmp_path, capsys, monkeypatch):
    """``eval`` sets JAX's GPU pool to the run's (run.json ``memory_pool``) before JAX starts, as ``train`` did;
    ``--memory-fraction`` overrides it and the environment's XLA_PYTHON_CLIENT_MEM_FRACTION wins over both."""
    import shutil

    from ulysses_jax.train import devices

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    record = json.loads((copy / "run.json").read_text())
    record["memory_pool"]["fraction"] = 0.8
    (copy / "run.json").write_text(json.dumps(record))
    for env, flags, want, why in ((None, [], "0.8", "the run's, from run.json"),
                                  (None, ["--memory-fraction", "0.7"], "0.7", "--memory-fraction"),
                                  ("0.6", [], "0.6", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 from the environment")):
        monkeypatch.setattr(devices, "_set_by_us", [])
        if env is None:
            monkeypatch.delenv(devices.MEMORY_FRACTION_ENV, raising=False)
        else:
            monkeypatch.setenv(devices.MEMORY_FRACTION_ENV, env)
        assert main(["eval", "--run-dir", str(copy), "--max-batches", "1", *flags]) == 0
        out = capsys.readouterr().out
        assert f"memory pool {float(want):.0%} of each GPU ({why}" in out, out
        assert os.environ[devices.MEMORY_FRACTION_ENV] == want
        assert json.loads((copy / "eval.jsonl").read_text().splitlines()[-1])["memory_fraction"] == float(want)
