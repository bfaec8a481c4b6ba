"""Fine-tuning as users run it, through the real entry point: the fine-tuning defaults of --init-from-hf (recorded,
printed, overridden by flags), SFT records longer than --seq-len (refused with the count and the longest, or dropped
and counted; never split), text documents cut and counted, hints that fit the mistake, resume refusals that say what
changed, and plan's exit status and next command when the plan does not fit."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest
import test_cli_hf as hf_helpers  # the tiny Hugging Face folder and the CLI helpers (a module: not collected twice)

from ulysses_jax.cli import EXIT_OVER, main, parse

FLAGS = hf_helpers.FLAGS  # --seq-len 64, fsdp 2 x sp 4, xla attention
cli, refused = hf_helpers.cli, hf_helpers.refused


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_helpers.make_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


def sft_file(path: pathlib.Path, short: int = 10, long: int = 2) -> pathlib.Path:
    """``short`` records that fit a 64-token row and ``long`` records of 80 prompt tokens, 84 in all (they do not)."""
    rng = np.random.default_rng(0)
    words = hf_helpers.WORDS
    records = [{"prompt": " ".join(rng.choice(words, 6)), "completion": " ".join(rng.choice(words, 4))}
               for _ in range(short)]
    records[3:3] = [{"prompt": "the sky is blue " * 20, "completion": "blue ."}] * long
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_without_an_answer_are_counted_and_a_folder_tokenizer_is_named_as_the_folders(folder, tmp_path,
                                                                                                capsys):
    from ulysses_jax.data.documents import DataConfig
    from ulysses_jax.data.lengths import empty_completion, measure

    assert empty_completion('{"prompt": "q", "completion": ""}') and not empty_completion('{"prompt": "q", '
                                                                                           '"completion": "a"}')
    assert empty_completion('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}')
    assert not empty_completion('{"messages": [{"role": "assistant", "content": "a"}]}')
    data = sft_file(tmp_path / "sft.jsonl")
    lines = data.read_text().splitlines()
    lines[5] = json.dumps({"prompt": "the sky", "completion": ""})
    data.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(paths=(str(data),), tokenizer=str(folder), format="sft", eval_fraction=0.0)
    found = measure(cfg, 128)
    assert found.empty == 1 and str(found).endswith(
        f"; 1 of 12 SFT records have an empty completion and train on the end-of-sequence token alone (the first: "
        f"line 6 of --data file {data})"), str(found)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "tokenizer.json").write_text("{not json")
    refused(capsys, ["train", "--init-from-hf", broken, "--run-dir", tmp_path / "run", *FLAGS],
            f"the tokenizer of --init-from-hf {broken / 'tokenizer.json'} is not a Hugging Face tokenizer.json",
            "(or pass another with --tokenizer)")
    assert not (tmp_path / "run").exists()


def test_fine_tuning_defaults_overlong_sft_dropped_and_an_edited_folder(folder, tmp_path, capsys):
    data, run = sft_file(tmp_path / "sft.jsonl"), tmp_path / "run"
    capsys.readouterr()
    assert main([str(a) for a in ("train", "--init-from-hf", folder, "--data-format", "sft", "--data", data,
                                  "--sft-overlong", "drop", "--steps", "3", "--eval-fraction", "0",
                                  "--optim.weight-decay", "0.05", "--run-dir", run, *FLAGS)]) == 0
    out = capsys.readouterr().out
    # the start-up lines: the records dropped (2 of 12, the longest named) and where each optimizer setting came from
    assert "12 SFT records (0 empty ones skipped): 10 kept for training, 2 dropped as longer than --seq-len 64 " \
           f"(--sft-overlong drop; the longest: 84 tokens, line 4 of --data file {data}), 0 held out for eval" in out, out
    assert "peak lr 2e-05 (fine-tuning default for --init-from-hf)" in out, out
    assert "warmup 1 step (3% of 3 steps, derived from --steps)" in out, out
    assert "weight decay 0.05," in out and "clip-norm 1 " in out, out  # the flag wins, and is not called a default
    record = json.loads((run / "run.json").read_text())
    optim = record["config"]["optim"]
    assert (optim["lr"], optim["warmup_steps"], optim["weight_decay"], optim["clip_norm"]) == (2e-5, 1, 0.05, 1.0)
    assert set(record["defaults"]) == {"optim.lr", "optim.warmup_steps", "optim.decay_steps"}
    assert record["defaults"]["optim.lr"] == {"value": 2e-5, "why": "fine-tuning default for --init-from-hf"}
    assert record["config"]["sft_overlong"] == "drop"
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[1])
    assert 0 < metrics["lr"] <= 2e-5  # the optimizer ran the recorded rate

    # the folder's config.json edited in place: the refusal says so, naming no flag the user did not give
    config = folder / "config.json"
    original = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(original), "rms_norm_eps": 1e-6}))
        err = refused(capsys, ["train", "--run-dir", run, "--resume", "--steps", "4"],
                      f"the folder's config.json changed since the run started ({folder.resolve()}); restore it")
        assert "--init-from-hf" not in err, err
    finally:
        config.write_text(original)


def test_sft_records_longer_than_a_row_are_refused_and_never_split(folder, tmp_path, capsys):
    from ulysses_jax.data.documents import DataConfig
    from ulysses_jax.data.pipeline import BatchIterator

    data = sft_file(tmp_path / "sft.jsonl")
    refused(capsys, ["train", "--init-from-hf", folder, "--data-format", "sft", "--data", data, "--run-dir",
                     tmp_path / "run", *FLAGS],
            f"2 of 12 SFT records are longer than --seq-len 64 (the longest: 84 tokens, line 4 of --data file {data})",
            "never split across rows", "raise --seq-len to at least 84", "--sft-overlong drop")
    assert not (tmp_path / "run").exists()
    only_long = sft_file(tmp_path / "long.jsonl", short=0)
    refused(capsys, ["train", "--init-from-hf", folder, "--data-format", "sft", "--data", only_long,
                     "--sft-overlong", "drop", "--run-dir", tmp_path / "run", *FLAGS],
            "all 2 SFT records are longer than --seq-len 64")
    # the rows themselves: every piece is a whole record that starts with <s> (bos: id 1); none over 64 tokens
    cfg = DataConfig(paths=(str(data),), tokenizer=str(folder), format="sft", eval_fraction=0.0, shuffle=False,
                     sft_overlong="drop")
    it = BatchIterator(cfg, seq_len=64, global_batch=2, seed=0)
    for _ in range(6):
        batch = next(it)
        for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
            starts = np.flatnonzero(np.diff(seg, prepend=0) > 0)
            assert len(starts) and all(tokens[s] == 1 for s in starts), (tokens, seg)
    with pytest.raises(ValueError, match="an SFT record of 84 tokens is longer than --seq-len 64"):
        next(BatchIterator(dataclasses.replace(cfg, sft_overlong="refuse"), seq_len=64, global_batch=1, seed=0))


def test_text_documents_cut_are_counted_and_a_derived_warmup_is_named(tmp_path, capsys):
    """A preset run prints how many text documents are cut; a run killed before its first checkpoint, started again
    with other --steps, is refused naming the warmup that --steps derived (a flag the user never gave)."""
    corpus = hf_helpers.write_corpus(tmp_path / "corpus.jsonl", n=30)
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--data", corpus, "--run-dir", run, *FLAGS]
    capsys.readouterr()
    assert main([str(a) for a in (*args, "--steps", "5")]) == 0
    out = capsys.readouterr().out
    cut = sum(len(json.loads(x)["text"].encode()) > 64 for x in corpus.read_text().splitlines())
    assert 0 < cut < 30 and f"{cut} of 30 text documents longer than --seq-len 64 are cut into pieces" in out, out
    assert "peak lr 0.003 (from-scratch default)" in out and "warmup 0 steps (10% of 5 steps" in out, out
    shutil.rmtree(run / "checkpoints")  # as if killed before its first checkpoint
    refused(capsys, [*args, "--steps", "20"], "holds another run that saved no checkpoint",
            "--optim.warmup-steps is 2 here (10% of 20 steps, derived from --steps) but 0 in the run (10% of 5 steps, "
            "derived from --steps); pass --optim.warmup-steps 0 to keep the run's")


def test_hints_that_fit(folder, tmp_path, capsys):
    new = ["--run-dir", tmp_path / "run", *FLAGS]
    sft = sft_file(tmp_path / "sft.jsonl")
    refused(capsys, ["train", "--data", sft, *new], "line 1 of --data file", "is an SFT record",
            "with --data-format sft")
    bad = tmp_path / "bad.jsonl"
    line = '{"prompt": "the sky" "completion": "blue"}'
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(line)
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    refused(capsys, ["train", "--data", bad, *new], f"line 2 of --data file {bad} is not valid JSON (Expecting ',' "
                                                    f"delimiter at column {e.value.colno})")
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "the sky"' + "\n")
    refused(capsys, ["train", "--data", bad, *new], "not valid JSON (Expecting ',' delimiter at the end of the line)")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused(capsys, ["train", "--data", empty, *new], f"--data {empty} is empty (0 bytes)")
    refused(capsys, ["train", "--data", empty, "--data-format", "sft", "--init-from-hf", folder, *new],
            f"--data {empty} is empty (0 bytes)")
    empty.write_text("\n\n")
    refused(capsys, ["train", "--data", empty, *new], f"--data {empty} holds only blank lines")
    assert not (tmp_path / "run").exists()


@pytest.mark.aot
def test_plan_over_exits_1_with_the_memory_auto_command(tmp_path, capsys):
    """OVER: exit status 1 (in --help), and the same command with --memory auto, which parses."""
    args = ["plan", "--preset", "tiny", "--devices", "1", "--mesh.sp", "1", "--seq-len", "512", "--no-kernels",
            "--budget-fraction", "0.0001",
            "--xla-log", str(tmp_path / "xla.log")]
    assert main(args) == EXIT_OVER
    out = capsys.readouterr().out
    assert "verdict: OVER" in out and "The plan does not fit (exit status 1)" in out, out
    suggested = out.strip().splitlines()[-1].split()
    assert suggested[:2] == ["ulysses-jax", "plan"] and suggested[-2:] == ["--memory", "auto"], suggested
    assert parse(suggested[1:]).memory == "auto"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "1 it does not (verdict OVER" in " ".join(capsys.readouterr().out.split())


@pytest.mark.aot
@pytest.mark.slow
def test_plan_memory_auto_that_finds_nothing_exits_1(tmp_path, capsys):
    """--memory auto with no set of memory tools within the budgets is a verdict (exit 1, one line), not a bad input."""
    args = ["plan", "--preset", "tiny", "--devices", "1", "--mesh.sp", "1", "--seq-len", "512", "--no-kernels",
            "--budget-fraction", "0.0001", "--memory", "auto", "--xla-log", str(tmp_path / "xla.log")]
    assert main(args) == EXIT_OVER
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no set of memory tools fits --seq-len 512"), err


@pytest.mark.aot
@pytest.mark.slow
def test_plan_keeps_xla_messages_in_a_log_file(tmp_path):
    """A plan larger than the device: XLA's rematerialization warning goes to the log file named, not the terminal."""
    log = tmp_path / "xla.log"
    r = cli("plan", "--preset", "tiny", "--devices", "1", "--mesh.sp", "1", "--seq-len", "1048576", "--no-kernels",
            "--xla-log", log, check=False)
    assert r.returncode == EXIT_OVER, r.stderr[-2000:]
    assert "rematerialization" in log.read_text() and "rematerialization.cc" not in r.stderr, r.stderr[-2000:]
    assert f"are in {log}" in r.stdout


def test_new_user_silences_are_said_at_start(folder, tmp_path, capsys):
    """Two cases that trained silently: a file that is not UTF-8 (read with U+FFFD, now counted at start), and a
    --seq-len past the folder's max_position_embeddings (now noted at start; export writes the trained length)."""
    import json as _json

    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("the sky is blue caf\xe9 na\xefve " * 20).encode("latin-1"))
    plain = tmp_path / "plain.txt"
    plain.write_text("the sky is blue \ufffd written as such " * 20)  # a U+FFFD in the file itself is not counted
    run = tmp_path / "run"
    capsys.readouterr()
    seq = ["--seq-len", "512", *FLAGS[2:]]  # the folder's max_position_embeddings is 256
    assert main([str(a) for a in ("train", "--init-from-hf", folder, "--data", latin, plain, "--steps", "1",
                                  "--eval-fraction", "0", "--run-dir", run, *seq)]) == 0
    out = capsys.readouterr().out
    assert "data: 40 byte sequence(s) in 1 file(s) are not UTF-8 and are read as U+FFFD" in out, out  # 2 x 20
    assert ("--seq-len 512 is past max_position_embeddings 256 of the folder's config.json: the model meets positions "
            "it was never trained on") in out, out
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert _json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 512


def test_a_folder_without_config_json_is_the_first_error(tmp_path, capsys):
    """An --init-from-hf folder with no config.json is named before the data is read (it was the third error of
    three, after two about the data)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text("{}")
    refused(capsys, ["train", "--init-from-hf", bare, "--data", tmp_path / "missing.txt", "--run-dir",
                     tmp_path / "run", *FLAGS], f"--init-from-hf {bare} has no config.json")
    assert not (tmp_path / "run").exists()


def test_sft_start_line_adds_up_with_held_out_records(folder, tmp_path, capsys):
    """kept for training + dropped from training + held out = the records read, with some records held out."""
    import re

    data = sft_file(tmp_path / "sft.jsonl", short=30, long=6)
    capsys.readouterr()
    assert main([str(a) for a in ("train", "--init-from-hf", folder, "--data-format", "sft", "--data", data,
                                  "--sft-overlong", "drop", "--steps", "1", "--eval-fraction", "0.3", "--run-dir",
                                  tmp_path / "run", *FLAGS)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"(\d+) SFT records \(0 empty ones skipped\): (\d+) kept for training, (\d+) dropped as longer than "
                  r"--seq-len 64 .*?, (\d+) held out for eval(?: \((\d+) of them dropped too\))?", out)
    assert m, out
    read, kept, dropped, held = (int(m.group(i)) for i in range(1, 5))
    assert read == 36 and kept + dropped + held == read and held > 0
    assert dropped + int(m.group(5) or 0) == 6  # every long record dropped, from training or from the held-out ones
