"""The CLI as users run it: a pulse of the real entry point, a signal and a crash then resume, resuming onto another
mesh from an earlier step, a run that remembers itself, eval reading the run, config files, and bad input."""

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ulysses_jax.cli import EXIT_STOPPED, main, parse
from ulysses_jax.train import runconfig

TINY = ["--preset", "tiny", "--seq-len", "256", "--attention", "xla", "--no-progress"]
MESH = ["--mesh.fsdp", "2", "--mesh.sp", "4"]


def env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI picks its own fake devices


def cli(*args, check=True, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "ulysses_jax", *args], capture_output=True, text=True, env=env(),
                          timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def records(run_dir, name="metrics.jsonl"):
    return [json.loads(x) for x in (pathlib.Path(run_dir) / name).read_text().splitlines()]


def losses(run_dir):
    """step -> loss; each step must be logged exactly once."""
    recs = records(run_dir)
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def snapshot(path: pathlib.Path):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")) if path.exists() else []


def write_corpus(path: pathlib.Path, n: int = 60, seed: int = 0) -> pathlib.Path:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "sequence", "parallel", "ulysses", "token", "device", "shard"]
    path.write_text("".join(
        json.dumps({"text": f"document {i}: " + " ".join(rng.choice(words, int(rng.integers(20, 120))))}) + "\n"
        for i in range(n)))
    return path


def save_tokenizer(path: pathlib.Path) -> pathlib.Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(["alpha beta gamma document"], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A 2-step run (checkpoints 1 and 2) on a jsonl corpus with a fifth held out."""
    root = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(root / "corpus.jsonl")
    run = root / "run"
    assert main(["train", *TINY, *MESH, "--steps", "2", "--checkpoint-every", "1", "--data", str(corpus),
                 "--eval-fraction", "0.2", "--run-dir", str(run)]) == 0
    return run, corpus


# ------------------------------------------------------------------------------------ the real entry point


def test_pulse_train_then_eval(tmp_path):
    run = tmp_path / "run"
    p = cli("train", *TINY, *MESH, "--steps", "2", "--checkpoint-every", "1", "--eval-every", "1",
            "--eval-batches", "1", "--run-dir", str(run))
    assert "No accelerator found: running on 8 fake CPU devices" in p.stdout
    assert "Data: " in p.stdout and "held out for eval" in p.stdout
    assert f"checkpoints: {run / 'checkpoints'}" in p.stdout and "--logdir" in p.stdout
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2] and all(np.isfinite(r["loss"]) for r in recs)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 and r["eval_loss"] > 0 for r in recs)
    assert sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit()) == [1, 2]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["mesh"] == {"data": 1, "fsdp": 2, "ring": 1, "sp": 4}
    assert "Memory pool: 95% of each GPU's memory (--memory-fraction default, what plan's budget assumes)" in p.stdout
    assert record["memory_pool"]["fraction"] == 0.95 and record["config"]["memory_fraction"] is None
    e = cli("eval", "--run-dir", str(run), "--max-batches", "1")  # no other flag: everything from the run
    assert "eval at step 2: loss" in e.stdout and "the run's held-out documents" in e.stdout
    assert [r["step"] for r in records(run, "eval.jsonl")] == [2]


def test_signal_and_crash_then_resume_matches_uninterrupted(tmp_path):
    """SIGTERM: the step under way finishes, a checkpoint is written, exit 75. Then a crash is simulated (the last
    checkpoint lost, metrics logged past the one left): `--resume` alone continues bit for bit, no step logged twice."""
    args = [*TINY, *MESH, "--batch-size", "2", "--steps", "6", "--checkpoint-every", "2"]
    cli("train", *args, "--run-dir", str(tmp_path / "straight"))
    want = losses(tmp_path / "straight")

    run = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "ulysses_jax", "train", *args, "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "training ended before the signal"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, out + err
    stopped = int(out.split("Stopped by SIGTERM after step ")[1].split(":")[0])
    assert 3 <= stopped < 6 and (run / "checkpoints" / str(stopped)).is_dir() and "--resume" in out
    assert max(losses(run)) == stopped
    shutil.rmtree(run / "checkpoints" / str(stopped))  # a crash: metrics now run past the last checkpoint
    cli("train", "--run-dir", str(run), "--resume")
    got = losses(run)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):  # deterministic on CPU: the same losses, bit for bit
        assert got[step] == want[step], (step, got[step], want[step])


# ------------------------------------------------------------------------------------ kill -9 at any moment

KILL = [*TINY, *MESH, "--batch-size", "2", "--checkpoint-every", "1"]


def logged(run) -> dict:
    """step -> loss of every complete line of metrics.jsonl (a kill may cut the last one short)."""
    out = {}
    for line in (pathlib.Path(run) / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        out[r["step"]] = r["loss"]
    return out


def saving(step):
    """True while Orbax writes the checkpoint of ``step`` or a later one (its temporary directory exists)."""
    def ready(run):
        d = pathlib.Path(run) / "checkpoints"
        names = [c.name for c in d.iterdir()] if d.is_dir() else []
        return any(".orbax-checkpoint-tmp" in n and int(n.split(".")[0]) >= step for n in names)
    return ready


def kill_when(ready, *args):
    """Run ``train *args`` and kill -9 it the moment ``ready()`` holds (polled every 2 ms)."""
    proc = subprocess.Popen([sys.executable, "-m", "ulysses_jax", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env())
    deadline = time.time() + 300
    try:
        while proc.poll() is None and not ready() and time.time() < deadline:
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"train ended ({proc.returncode}) before the kill point"


def resume(run, **kw):
    p = cli("train", "--run-dir", str(run), "--resume", check=False, **kw)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    return p


def test_kill_during_an_asynchronous_checkpoint_then_resume(tmp_path):
    """kill -9 while Orbax writes a checkpoint, then leftovers of worse moments (another save's temporary directory,
    half a metrics line, half a run.json): `train --resume` alone continues from the last complete checkpoint and
    computes the lost steps again to the same losses, each step logged once, the leftovers cleaned."""
    run = tmp_path / "run"
    kill_when(lambda: saving(2)(run), *KILL, "--steps", "4", "--run-dir", str(run))
    before, done = logged(run), runconfig.inspect(run).steps
    assert done and 1 <= done[-1] <= max(before), (before, done)  # killed before its save of step >= 2 completed
    junk = run / "checkpoints" / f"{done[-1] + 1}.orbax-checkpoint-tmp-1795000000"
    (junk / "params").mkdir(parents=True, exist_ok=True)
    (junk / "params" / "half").write_bytes(b"\0" * 100)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.2')
    (run / "run.json.tmp").write_text('{"version": 1, "conf')
    p = resume(run)
    assert f"Continuing {run} from step {done[-1]}" in p.stdout, p.stdout
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in before.items():  # the steps computed again: bit for bit (deterministic on CPU)
        assert got[step] == loss, (step, got[step], loss)
    assert runconfig.inspect(run).steps[-1] == 4 and not junk.exists()
    assert [c.name for c in (run / "checkpoints").iterdir() if not c.name.isdigit()] == []


@pytest.mark.slow
def test_kill_at_many_moments_then_resume_matches_uninterrupted(tmp_path):
    """One run killed -9 five times (after writing its record, before any checkpoint; while saving; in the middle of
    a step; while a resumed run restores and compiles; while saving again), each time continued with `--resume`
    alone: the losses of an uninterrupted run, bit for bit."""
    cli("train", *KILL, "--steps", "6", "--run-dir", str(tmp_path / "straight"))
    want = losses(tmp_path / "straight")
    run = tmp_path / "run"
    args = [*KILL, "--steps", "6", "--run-dir", str(run)]
    kill_when(lambda: (run / "run.json").exists(), *args)  # before the first checkpoint: it starts again from 0
    assert runconfig.inspect(run).steps == ()
    again = ["--run-dir", str(run), "--resume"]
    kill_when(lambda: saving(2)(run), *again)
    kill_when(lambda: max(logged(run), default=0) >= 4 and not saving(4)(run), *again)  # mid-step
    t0 = time.time()
    kill_when(lambda: time.time() > t0 + 3, *again)  # a resumed run restoring and compiling
    kill_when(lambda: saving(5)(run), *again)
    resume(run)
    got = losses(run)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == want[step], (step, got[step], want[step])
    record = json.loads((run / "run.json").read_text())
    assert len(record["starts"]) >= 3 and record["starts"][0]["step"] == 0


def test_more_sp_than_heads_is_refused(tmp_path):
    p = cli("train", *TINY, "--cpu-devices", "16", "--mesh.fsdp", "1", "--mesh.sp", "16", "--batch-size", "1",
            "--steps", "1", "--run-dir", str(tmp_path / "r"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == ("error: --mesh.sp (16) exceeds the model's query heads (8): Ulysses splits heads "
                                "over sp; use --mesh.sp <= 8")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------ a run remembers itself


def test_resume_onto_another_mesh_from_an_earlier_step(tmp_path):
    """Saved with fsdp=2 x sp=4, continued from step 2 with fsdp=4 x sp=2 and no other flag: same trajectory,
    the same learning rate, later checkpoints set aside, no step logged twice."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *TINY, *MESH, "--batch-size", "4", "--steps", "4", "--checkpoint-every", "2",
                 "--run-dir", str(a)]) == 0
    shutil.copytree(a, b)
    assert main(["train", "--run-dir", str(b), "--resume-from", "2", "--mesh.fsdp", "4", "--mesh.sp", "2"]) == 0
    ra, rb = {r["step"]: r for r in records(a)}, {r["step"]: r for r in records(b)}
    assert sorted(losses(b)) == [1, 2, 3, 4] and (b / "checkpoints-set-aside" / "4").is_dir()
    for step in (3, 4):  # other mesh, other reduction order: equal to float32 rounding
        np.testing.assert_allclose(rb[step]["loss"], ra[step]["loss"], rtol=2e-5)
        assert rb[step]["lr"] == ra[step]["lr"]
    record = json.loads((b / "run.json").read_text())
    assert [s["mesh"]["sp"] for s in record["starts"]] == [4, 2] and record["config"]["mesh"]["sp"] == 2


def test_resume_with_the_optimizer_moved_to_host_memory(tmp_path):
    """A run saved with the optimizer on the device (its state stacked) continues with --optim.offload (kept by layer
    in host memory: the checkpoint converted as it is read): the same trajectory, and its own checkpoints resume."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *TINY, *MESH, "--batch-size", "4", "--steps", "4", "--checkpoint-every", "2",
                 "--run-dir", str(a)]) == 0
    shutil.copytree(a, b)
    assert main(["train", "--run-dir", str(b), "--resume-from", "2", "--steps", "3", "--optim.offload"]) == 0
    assert main(["train", "--run-dir", str(b), "--resume", "--steps", "4", "--optim.offload"]) == 0
    ra, rb = {r["step"]: r for r in records(a)}, {r["step"]: r for r in records(b)}
    assert sorted(losses(b)) == [1, 2, 3, 4]
    for step in (3, 4):  # the streamed update fuses differently: equal to float32 rounding
        np.testing.assert_allclose(rb[step]["loss"], ra[step]["loss"], rtol=2e-5)


def test_run_dir_of_another_run_is_refused(existing_run, tmp_path, capsys):
    run, corpus = existing_run
    other = write_corpus(tmp_path / "other.jsonl", seed=1)
    tok = save_tokenizer(tmp_path / "tokenizer.json")
    before = snapshot(run)
    cases = [
        (["train", *TINY, *MESH, "--steps", "3", "--data", str(corpus), "--run-dir", str(run)],
         "already holds checkpoints; pass --resume"),
        (["train", "--run-dir", str(run), "--resume"], "the run is at step 2 of --steps 2; raise --steps"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--seq-len", "512"],
         "cannot continue {run} with other settings: --seq-len is 512 here but 256 in the run"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--batch-size", "4"],
         "--batch-size is 4 here but 2 in the run"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--optim.lr", "0.01"],
         "--optim.lr is 0.01 here but 0.003 in the run"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--data", str(other)],
         f"--data {other} (60 documents) is not the run's {corpus}"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--tokenizer", str(tok)],
         "is not the run's tokenizer"),
        (["train", "--run-dir", str(run), "--resume-from", "5", "--steps", "6"], "--resume-from 5: no such checkpoint"),
        (["train", "--run-dir", str(run), "--resume", "--steps", "3", "--optim.decay-steps", "1"],
         "--optim.decay-steps (1) must be after the step the run continues from (2)"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message.format(run=run) in err, (args, err)
    # master weights change the optimizer-state tree: refused by name through the real entry point (it used to be
    # "checkpoint ... is damaged or not from this run"); the other direction is test_cli_hf's master-weights export
    p = cli("train", "--run-dir", str(run), "--resume", "--steps", "3", "--optim.master-weights", check=False)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: cannot continue {run} with other settings: --optim.master-weights is True here but False in the run; "
        f"resume without that flag, or start a new --run-dir"), p.stderr
    assert snapshot(run) == before


def test_remat_nesting_is_a_compute_setting_a_resume_may_change():
    """`--remat-nested` was recorded as a learned model field: a run with it could not resume with another `--remat`
    (refused as needing offload, then as another model), nor could one without it add it (found by a review). It is
    compute-only now; a run recorded before, with it among the model's fields, is compared without it."""
    from ulysses_jax.train.config import TrainConfig
    from ulysses_jax.train.resume import learned_difference
    from ulysses_jax.train.runconfig import COMPUTE_ONLY, to_dict

    assert "remat_nested" in COMPUTE_ONLY
    config = to_dict(TrainConfig())
    old = {"config": config, "model": {"hidden": 8, "remat_nested": True}}
    assert learned_difference(old, {"config": config, "model": {"hidden": 8}}) is None
    assert learned_difference(old, {"config": config, "model": {"hidden": 16}}) == (
        "the model's hidden is 16 here but 8 in the run")


def test_run_dir_without_checkpoints(existing_run, tmp_path, capsys):
    """A directory whose run saved no checkpoint: another run is refused; the same run starts again cleanly."""
    run, corpus = existing_run
    half = tmp_path / "half"
    shutil.copytree(run, half)
    shutil.rmtree(half / "checkpoints")
    before = snapshot(half)
    same = ["train", *TINY, *MESH, "--steps", "1", "--data", str(corpus), "--eval-fraction", "0.2", "--run-dir",
            str(half)]
    assert main([*same[:-2], "--seq-len", "512", "--run-dir", str(half)]) == 2
    err = capsys.readouterr().err
    assert "holds another run that saved no checkpoint (--seq-len is 512 here but 256 in the run)" in err
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main([*same[:-1], str(tmp_path / "orphan")]) == 2
    assert "holds metrics of a run without run.json" in capsys.readouterr().err
    assert snapshot(half) == before
    assert main(same) == 0
    assert "starting it again from step 0" in capsys.readouterr().out
    assert sorted(losses(half)) == [1]


def test_eval_reads_the_run_and_refuses_other_data(existing_run, tmp_path, capsys):
    run, corpus = existing_run
    assert main(["eval", "--run-dir", str(run), "--max-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "eval at step 2" in out and "the run's held-out documents" in out
    other = write_corpus(tmp_path / "other.jsonl", n=10, seed=2)
    tok = save_tokenizer(tmp_path / "tokenizer.json")
    original = corpus.read_text()
    for args, message in [
        (["--data", str(other)], f"--data {other} (10 documents) is not the run's {corpus} (60): its held-out"),
        (["--tokenizer", str(tok)], "is not the run's tokenizer (bytes, vocabulary 256); evaluate with the run's own"),
        (["--step", "7"], "--step 7: no such checkpoint"),
    ]:
        assert main(["eval", "--run-dir", str(run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    corpus.write_text(original.replace("document 3:", "document three:"))
    try:
        assert main(["eval", "--run-dir", str(run)]) == 2
        assert f"--data {corpus} has changed since the run" in capsys.readouterr().err
    finally:
        corpus.write_text(original)
    moved = tmp_path / "moved.jsonl"  # the same documents elsewhere: accepted
    shutil.copy(corpus, moved)
    assert main(["eval", "--run-dir", str(run), "--data", str(moved), "--max-batches", "1"]) == 0
    assert main(["eval", "--run-dir", str(run), "--step", "1", "--eval-data", str(other), "--mesh.fsdp", "4",
                 "--mesh.sp", "2", "--loss-chunk", "32"]) == 0
    assert "--eval-data" in capsys.readouterr().out
    # no --mesh flag: the run's own mesh (fsdp 2 x sp 4); the flags given: theirs
    assert [(r["step"], r["mesh"]["sp"]) for r in records(run, "eval.jsonl")][-3:] == [(2, 4), (2, 4), (1, 2)]
    # read-only: a run without checkpoints gets nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text((run / "run.json").read_text())
    before = snapshot(empty)
    assert main(["eval", "--run-dir", str(empty)]) == 2
    assert "no checkpoint in" in capsys.readouterr().err and snapshot(empty) == before


LLAMA_YAML = """\
preset: llama3.1-8b
seq_len: 131072
batch_size: 1
steps: 2000
mesh: {data: 1, fsdp: 1, sp: 8}
attention: auto
remat: full
loss_chunk: 4096
mlp_chunk: 4096
optim:
  lr: 3.0e-4
  warmup_steps: 100
  min_lr_ratio: 0.1
data: [/path/to/corpus.jsonl]
data_field: text
tokenizer: /path/to/tokenizer.json
eval_every: 200
eval_batches: 8
checkpoint_every: 100
"""


def test_config_file_and_flags(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("preset: tiny\nseq-len: 256\nsteps: 1\nattention: xla\nprogress: false\n"
                                       "mesh: {fsdp: 2, sp: 4}\noptim:\n  lr: 0.001\n  warmup_steps: 0\n")
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--optim.lr", "0.002", "--run-dir", str(run)]) == 0
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["optim"]["lr"] == 0.002 and record["config"]["seq_len"] == 256
    again = parse(["train", "--config", str(run / "config.yaml")])  # the run's effective config loads back
    assert again.optim.lr == 0.002 and again.mesh.sp == 4 and again.batch_size == 2 and again.steps == 1
    # ... but for what the run derived: the decay from --steps 1 (run.json: 1), derived again from a longer --steps
    # (it was written as given: a new run with --steps 12 held the minimum rate from step 2 on; found by a review)
    assert record["config"]["optim"]["decay_steps"] == 1 and "optim.decay_steps" in record["defaults"]
    assert "left to be derived again (run.json has the values it used): optim.decay_steps, optim.weight_decay." in (
        run / "config.yaml").read_text()
    longer = parse(["train", "--config", str(run / "config.yaml"), "--steps", "12"])
    assert longer.optim.decay_steps is None and longer.optim.warmup_steps == 0 and longer.optim.lr == 0.002
    (tmp_path / "llama.yaml").write_text(LLAMA_YAML)  # the README's 8-GPU recipe loads as written
    llama = parse(["train", "--config", str(tmp_path / "llama.yaml")])
    assert (llama.preset, llama.seq_len, llama.mesh.sp, llama.remat, llama.optim.lr) == (
        "llama3.1-8b", 131072, 8, "full", 3e-4)
    (tmp_path / "run.toml").write_text('steps = 5\n[mesh]\nsp = 2\n')
    cfg = parse(["train", "--config", str(tmp_path / "run.toml"), "--steps", "7"])
    assert cfg.steps == 7 and cfg.mesh.sp == 2


def test_help_lists_presets_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("llama3.1-8b", "qwen2.5-0.5b", "--optim.decay-steps", "--data PATH", "--data-field", "--eval-data",
                 "--eval-fraction", "--tokenizer", "--eval-every", "--resume-from", "--config", "--wandb-project",
                 "0: auto", "(default: 24)"):
        assert text in out, text


def test_defaults_fit_8_devices_and_one_node():
    import jax

    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.train.devices import MeshConfig, build_mesh, resolve_batch

    cfg = parse(["train"])
    tiny = ModelConfig.from_preset(cfg.preset)
    mesh = build_mesh(cfg.mesh, tiny, cfg.seq_len)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "ring": 1, "sp": 8} and resolve_batch(cfg.batch_size, mesh) == 2
    big = ModelConfig.from_preset("llama3.1-8b")
    assert dict(build_mesh(cfg.mesh, big, 131072).shape)["sp"] == 8
    four = build_mesh(MeshConfig(), tiny, 2048, devices=jax.devices()[:4])
    assert dict(four.shape) == {"data": 1, "fsdp": 1, "ring": 1, "sp": 4}
    two_rows = build_mesh(MeshConfig(fsdp=2), tiny, 2048)
    assert dict(two_rows.shape) == {"data": 1, "fsdp": 2, "ring": 1, "sp": 4} and resolve_batch(None, two_rows, 2) == 4
    odd = build_mesh(MeshConfig(), tiny, 2049 * 2)  # 4098 = 2 x 3 x 683: sp must divide it
    assert dict(odd.shape)["sp"] == 2


def test_an_automatic_mesh_says_why_sp_fell_and_refusals_advise_a_length_that_keeps_it():
    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.train.devices import MeshConfig, auto_sp_note, build_mesh, sequence_multiple

    tiny = ModelConfig.from_preset("tiny")
    mesh = build_mesh(MeshConfig(), tiny, 99)
    assert dict(mesh.shape)["sp"] == 1
    assert auto_sp_note(MeshConfig(), tiny, 99, mesh) == (
        "sp 1, not 8: --seq-len 99 is not a multiple of 8; --seq-len 104 (or --mesh.sp 8, which refuses this length) "
        "keeps sp 8")
    assert auto_sp_note(MeshConfig(), tiny, 104, build_mesh(MeshConfig(), tiny, 104)) is None
    assert auto_sp_note(MeshConfig(sp=1), tiny, 99, mesh) is None  # asked for: nothing fell
    assert sequence_multiple(MeshConfig()) == 8 and sequence_multiple(MeshConfig(sp=2, ring=2)) == 4
    from ulysses_jax.data.lengths import _keeps_mesh

    assert _keeps_mesh(99, 8) == " (104: a multiple of 8 keeps the sequence split over the mesh)"
    assert _keeps_mesh(96, 8) == "" and _keeps_mesh(99, 1) == ""


def test_options_of_a_tool_the_run_does_not_use_are_said_or_dropped():
    """A cuDNN-only option on another kernel is named unused on the start line (a run that resolves `auto` to cuDNN
    on a GPU uses it, so it is not refused); eval and export with `--remat none` (or full) on a run recorded with
    `--remat offload --remat-every 2 --remat-nested` drop the groups and the nesting with the tool, as a resume does,
    instead of refusing the run's own settings."""
    import dataclasses

    from ulysses_jax.model.config import ModelConfig
    from ulysses_jax.train.config import COMPUTE_ONLY, model_config_from_run
    from ulysses_jax.train.devices import MeshConfig, build_mesh, impl_note

    tiny = ModelConfig.from_preset("tiny", attn_max_documents=1)
    mesh = build_mesh(MeshConfig(), tiny, 256)
    assert impl_note(tiny, mesh) == "auto -> blockwise (--attn-max-documents 1 applies to cuDNN only: unused)"
    assert impl_note(dataclasses.replace(tiny, attention_impl="xla"), mesh) == (
        "xla; --attn-max-documents 1 applies to cuDNN only: unused")
    assert impl_note(dataclasses.replace(tiny, attn_max_documents=0), mesh) == "auto -> blockwise"
    model = dataclasses.asdict(ModelConfig.from_preset("tiny", remat="offload", remat_every=2, remat_nested=True))
    record = {"model": {k: v for k, v in model.items() if k not in COMPUTE_ONLY},
              "compute": {k: model[k] for k in COMPUTE_ONLY}}
    assert model_config_from_run(record).remat_every == 2
    off = model_config_from_run(record, remat="none")
    assert (off.remat, off.remat_every, off.remat_nested) == ("none", 1, False)
    full = model_config_from_run(record, remat="full")
    assert (full.remat, full.remat_every, full.remat_nested) == ("full", 2, False)
    # a run that kept attention's output and the MLP's products (--memory auto may pick it): eval on other memory
    # tools drops what they leave nothing to do (found by a review: refused, with no --no-mlp-keep to give eval)
    model = dataclasses.asdict(ModelConfig.from_preset("tiny", remat="full", mlp_chunk=0, attn_keep=True,
                                                       mlp_keep=True))
    record = {"model": {k: v for k, v in model.items() if k not in COMPUTE_ONLY},
              "compute": {k: model[k] for k in COMPUTE_ONLY}}
    kept = lambda m: (m.attn_keep, m.mlp_keep)  # noqa: E731
    assert kept(model_config_from_run(record)) == (True, True)
    assert kept(model_config_from_run(record, mlp_chunk=64)) == (True, False)
    assert kept(model_config_from_run(record, remat="offload")) == (True, False)
    assert kept(model_config_from_run(record, remat="save_matmuls")) == (True, False)
    assert kept(model_config_from_run(record, remat_every=2)) == (True, False)
    assert kept(model_config_from_run(record, remat="none")) == (False, False)
    assert kept(model_config_from_run(record, attn_chunk=64)) == (False, True)
    assert kept(model_config_from_run(record, remat="full", mlp_chunk=0, attn_chunk=0)) == (True, True)


# ------------------------------------------------------------------------------------ failures


def test_a_signal_stops_after_the_step_and_a_second_one_at_once():
    import threading

    from ulysses_jax.train.signals import _StopSignals

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    before = signal.getsignal(signal.SIGINT)
    with _StopSignals() as signals:
        assert not signals.stop()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals.signum == signal.SIGINT and signals.stop()  # no KeyboardInterrupt: the loop saves first
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_during_the_last_step_or_its_save_ends_the_run_saved(tmp_path, monkeypatch, capsys):
    """Found by a review: a SIGTERM while the last checkpoint was written killed the process (status 143, the save
    lost: the handlers were gone by then); a stop asked during the last step exited 75 and printed a `--resume` that
    then failed (the run was at --steps). Both now end the run as done, exit 0, its last checkpoint saved."""
    import threading

    from ulysses_jax.train import signals
    from ulysses_jax.train.checkpoint import Checkpointer
    from ulysses_jax.train.runconfig import inspect

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    real_close = Checkpointer.close

    def close(self):  # the last save is still being written when SIGTERM comes
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        return real_close(self)

    monkeypatch.setattr(Checkpointer, "close", close)
    monkeypatch.setattr(signals._StopSignals, "stop", lambda self: True)  # a stop asked during every step
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Done: " in out and "Stopped by" not in out and inspect(run).steps == (1,)


def test_tensorboard_shows_what_metrics_jsonl_holds_after_a_kill(tmp_path):
    """A run killed after step 3 (checkpoint at 2) whose TensorBoard events never left the writer's queue (its file
    empty, as kill -9 left it): the resume showed steps 3 on only (a review); it writes the kept records again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ulysses_jax.train.metrics import MetricsLogger, log_eval

    log = MetricsLogger(tmp_path, total_steps=4, first_step=0, progress=False)
    for step in (1, 2, 3):
        log.log({"step": step, "loss": 1.0 / step})
    log.close()
    for f in log.tb_dir.glob("events.out.tfevents.*"):
        f.write_bytes(b"")  # lost with the process
    log_eval(tmp_path, {"step": 2, "loss": 0.25, "perplexity": 1.3})  # a standalone `eval` of checkpoint 2: kept too
    resumed = MetricsLogger(tmp_path, total_steps=4, first_step=2, progress=False)
    for step in (3, 4):
        resumed.log({"step": step, "loss": 2.0 / step})
    resumed.close()
    events = EventAccumulator(str(log.tb_dir))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]  # float32 values
    assert got == [(1, 1.0), (2, 0.5), (3, pytest.approx(2 / 3)), (4, 0.5)], got
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 0.25)]


def _poisoned_run(tmp_path, poison, **cfg):
    """A tiny run (fsdp 2 x sp 4, a checkpoint every step) whose third step's ``(state, metrics)`` pass through
    ``poison``."""
    from ulysses_jax.train.config import TrainConfig
    from ulysses_jax.train.devices import MeshConfig
    from ulysses_jax.train.trainer import setup_train

    run = setup_train(TrainConfig(preset="tiny", batch_size=2, checkpoint_every=1, progress=False, attention="xla",
                                  mesh=MeshConfig(fsdp=2, sp=4), run_dir=str(tmp_path / "run"), **cfg))
    real_step, calls = run.step_fn, []

    def poisoned(state, batch):
        state, metrics = real_step(state, batch)
        calls.append(1)
        return poison(state, metrics) if len(calls) == 3 else (state, metrics)

    run.step_fn = poisoned
    return run


def _saved_steps(tmp_path) -> list[int]:
    return sorted(int(d.name) for d in (tmp_path / "run" / "checkpoints").iterdir() if d.name.isdigit())


def test_non_finite_loss_stops_and_names_the_last_good_checkpoint(tmp_path):
    import jax.numpy as jnp

    from ulysses_jax.train.trainer import TrainingDiverged, train_run

    run = _poisoned_run(tmp_path, lambda state, metrics: (state, {**metrics, "loss": jnp.nan}), seq_len=256, steps=5)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3; stopped without saving \(last good checkpoint: "
                                               r"step 2 in .*checkpoints: continue from it with --resume, or from an "
                                               r"earlier one with --resume-from STEP\)"):
        train_run(run)
    assert _saved_steps(tmp_path) == [1, 2] and max(losses(tmp_path / "run")) == 2


@pytest.mark.parametrize("poison", ["grad_norm", "params"])
def test_a_non_finite_update_is_never_saved(tmp_path, poison):
    """A step whose loss is finite but whose gradient is not (the update then wrote NaN parameters), or whose
    parameters overflowed (a finite gradient times a huge rate), stops before its checkpoint, naming the last good one
    (a review found such a step saved and called good: `--optim.lr 1e30` exited 0 with NaN weights)."""
    import jax
    import jax.numpy as jnp

    from ulysses_jax.train.trainer import TrainingDiverged, train_run

    def bad(state, metrics):
        if poison == "grad_norm":
            return state, {**metrics, "grad_norm": jnp.nan}
        return {**state, "params": jax.tree.map(lambda x: x * jnp.inf, state["params"])}, metrics

    run = _poisoned_run(tmp_path, bad, seq_len=128, steps=4)
    what = "the gradient's norm is nan at step 3" if poison == "grad_norm" else (
        "the parameters are not finite after step 3")
    with pytest.raises(TrainingDiverged, match=rf"^{what}; stopped without saving \(last good checkpoint: step 2 in "):
        train_run(run)
    assert _saved_steps(tmp_path) == [1, 2]


def test_damaged_checkpoint_is_named_and_io_errors_are_not_called_damage(existing_run, tmp_path, capsys, monkeypatch):
    run, _ = existing_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for f in (copy / "checkpoints" / "2" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size:
            f.write_bytes(b"not a checkpoint")
    before = snapshot(copy)
    assert main(["train", "--run-dir", str(copy), "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume-from STEP (here: 1)" in err
    assert err.startswith(f"error: checkpoint {copy / 'checkpoints' / '2'} is damaged or not from this run")
    assert snapshot(copy) == before

    import errno

    import orbax.checkpoint as ocp

    def failing(self, step, args=None):
        raise OSError(errno.EIO, "Input/output error", str(run / "checkpoints" / str(step)))

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)
    assert main(["eval", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be read: I/O error (Input/output error" in err and "damaged" not in err


# ------------------------------------------------------------------------------------ bad input


def _files(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\n{"text": \n')
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": " "}\n')
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    (tmp_path / "unknown.yaml").write_text("stepz: 3\n")
    (tmp_path / "wrongtype.yaml").write_text("steps: many\n")
    (tmp_path / "broken.yaml").write_text("steps: [1\n")
    (tmp_path / "run.ini").write_text("[x]\n")
    (tmp_path / "resume.yaml").write_text("run_dir: somewhere\nresume: true\n")
    (tmp_path / "afile").write_text("x")


TRAIN_ERRORS = {
    "mesh product": (MESH[:1] + ["3", "--mesh.sp", "2"],
                     r"--mesh.data 1 x --mesh.fsdp 3 x --mesh.sp 2 = 6 but there are 8 devices"),
    "mesh negative": (["--mesh.sp", "-2"], r"--mesh.sp \(-2\) must be a positive number or 0 \(auto\) of devices"),
    "seq not a multiple of sp": (["--mesh.sp", "4", "--seq-len", "250"],
                                 r"--seq-len \(250\) must be a positive multiple of --mesh.sp \(4\)"),
    "batch": ([*MESH, "--batch-size", "3"],
              r"--batch-size \(3\) must be a multiple of --grad-accum \(1\) x --mesh.data"),
    "preset": (["--preset", "gpt5"], r"unknown preset 'gpt5'; choose one of tiny, "),
    "data missing": (["--data", "/no/such/file.txt"], r"--data /no/such/file.txt does not exist"),
    "resume without checkpoints": (["--resume"], r"--resume: no checkpoint in"),
    "chunk": (["--mesh.sp", "4", "--loss-chunk", "7"],
              r"--loss-chunk \(7\) must divide the per-device sequence length \(64 = seq / sp\)"),
    "cudnn on cpu": (["--attention", "cudnn"], r"--attention cudnn: cannot serve this call: cuDNN needs a GPU but the "
                                               r"devices' platform is cpu; use --attention pallas or auto"),
    "window": (["--sliding-window", "-3"], r"sliding.window \(-3\) must be 0 \(no local layers\) or a positive number "
                                          r"of tokens"),
    "gemma window 0": (["--preset", "gemma3-1b", "--sliding-window", "0"],
                       r"layer.pattern has 'local' layers but sliding.window is 0"),
    "unknown flag": (["--stepz", "3"], r"Unrecognized options: --stepz, 3 \(did you mean --steps\?\); see"),
    "not an integer": (["--steps", "abc"], r"Error parsing --steps: 'abc' is not an integer"),
    "bad choice": (["--attention", "foo"], r"invalid choice 'foo' for argument '--attention'"),
    "zero steps": (["--steps", "0"], r"--steps \(0\) must be at least 1"),
    "zero grad accum": (["--grad-accum", "0"], r"--grad-accum \(0\) must be at least 1"),
    # one token a row has no next token to predict: it trained on nothing, exit 0 (found by a review)
    "one token a row": (["--seq-len", "1"], r"--seq-len \(1\) must be at least 2"),
    # the schedule cut a warmup longer than the decay to decay - 1 while the start line said the given one
    "warmup past the decay": (["--steps", "4", "--optim.warmup-steps", "10"],
                              r"--optim.warmup-steps \(10\) must be below the decay steps \(4, --steps\), where the "
                              r"rate falls from its peak; lower it or raise --steps"),
    "negative eval every": (["--eval-every", "-1"], r"--eval-every \(-1\) must be at least 0"),
    "eval fraction": (["--eval-fraction", "1.5"], r"--eval-fraction 1.5 must be in \[0, 1\)"),
    "missing field": (["--data", "{d}/c.jsonl", "--data-field", "body"], r"has no field 'body'.*--data-field"),
    "malformed jsonl": (["--data", "{d}/bad.jsonl"], r"line 2 of --data file .*bad.jsonl is not valid JSON"),
    "only empty documents": (["--data", "{d}/empty.jsonl"], r"holds only empty documents \(2 of them\)"),
    "sentencepiece": (["--tokenizer", "{d}/m"], r"--tokenizer .*m holds a sentencepiece tokenizer.model"),
    "negative lr": (["--optim.lr", "-1"], r"--optim.lr \(-1.0\) must be > 0"),
    "profile steps": (["--profile-steps", "5"], r"--profile-steps '5' must look like A:B"),
    "partial launch flags": (["--num-processes", "2"], r"--coordinator-address, --num-processes and --process-id go "),
    "cpu devices": (["--cpu-devices", "0"], r"--cpu-devices \(0\) must be at least 1"),
    "config missing": (["--config", "{d}/nope.yaml"], r"--config .*nope.yaml does not exist"),
    "config unknown key": (["--config", "{d}/unknown.yaml"], r"unknown setting 'stepz'; did you mean 'steps'\?"),
    "config wrong type": (["--config", "{d}/wrongtype.yaml"], r"wrongtype.yaml: steps is 'many', not an integer"),
    "config not yaml": (["--config", "{d}/broken.yaml"], r"--config .*broken.yaml is not valid YAML"),
    "config extension": (["--config", "{d}/run.ini"], r"unknown extension '.ini'; use a .yaml, .yml or .toml file"),
    # a run's record was never read for it: its settings fell back to defaults, then refused as changed (a review)
    "config resumes": (["--config", "{d}/resume.yaml"], r"--config .*resume.yaml sets resume, which continues a run; "
                                                        r"give it on the command line \(--run-dir R --resume\)"),
    "wandb missing": (["--wandb-project", "p"], r"--wandb-project needs the wandb package: pip install wandb"),
    "run dir is a file": (["--run-dir", "{d}/afile"], r"--run-dir .*afile is a file"),
    "ring zero": (["--mesh.ring", "0"], r"--mesh.ring \(0\) must be a positive number of devices"),
    "ring product": (["--mesh.fsdp", "3", "--mesh.ring", "2", "--mesh.sp", "2"],
                     r"--mesh.data 1 x --mesh.fsdp 3 x --mesh.ring 2 x --mesh.sp 2 = 12 but there are 8 devices"),
    "ring seq": (["--mesh.ring", "2", "--mesh.sp", "4", "--seq-len", "252"],
                 r"--seq-len \(252\) must be a positive multiple of --mesh.ring x --mesh.sp \(2 x 4\) and of "
                 r"2 x --mesh.ring \(4, the zigzag order\): a multiple of 8"),
    "remat choice": (["--remat", "bogus"], r"invalid choice 'bogus' for argument '--remat'. Expected one of full, none, "
                                           r"offload, save_matmuls; see `ulysses-jax train --help`"),
    "offload params alone": (["--offload-params"], r"--offload-params needs --optim.offload: the update must stream"),
    "offload params accum": (["--offload-params", "--optim.offload", "--grad-accum", "2", "--batch-size", "2"],
                             r"--offload-params takes --grad-accum 1 \(got 2\)"),
    "attn chunk with a ring": (["--mesh.ring", "2", "--mesh.sp", "4", "--attn-chunk", "16"],
                               r"--attn-chunk \(16\) tiles the Ulysses exchange of a mesh without a ring; with "
                               r"--mesh.ring 2 use --attn-chunk 0"),
    "attn chunk": (["--mesh.sp", "4", "--attn-chunk", "48"],
                   r"--attn-chunk \(48\) must divide the per-device sequence length \(64 = seq / sp\)"),
    "attn head chunk": (["--mesh.sp", "4", "--attn-chunk", "16", "--attn-head-chunk", "3"],
                        r"--attn-head-chunk \(3\) must divide the 2 query heads each device computes \(8 heads, 4 KV "
                        r"heads over sp=4\) and be a multiple or a divisor of the 2 query heads per KV head there; "
                        r"choose one of 1, 2, or 0 for one group"),
    "attn head chunk alone": (["--attn-head-chunk", "2"], r"--attn-head-chunk \(2\) groups the heads of the tiled "
                                                          r"attention sublayer; add --attn-chunk"),
    "attn recompute alone": (["--attn-recompute"], r"--attn-recompute recomputes the output of the tiled attention "
                                                   r"sublayer; add --attn-chunk"),
    "ring kernel": (["--mesh.ring", "2", "--mesh.sp", "4", "--attention", "cudnn"],
                    r"--attention cudnn has no ring kernel; with --mesh.ring 2 use --attention xla, blockwise, "
                    r"pallas, auto"),
    # a setting that qualifies a tool the run does not use: accepted and ignored before (found by a review)
    "remat every without remat": (["--remat", "none", "--remat-every", "2"],
                                  r"remat_every \(2, --remat-every\) groups the layers that remat re-runs, but remat "
                                  r"is 'none'; set remat"),
    "moe impl on a dense model": (["--moe-impl", "pallas"], r"moe_impl \('pallas', --moe-impl\) chooses the experts' "
                                                            r"grouped matmul, but tiny has no experts"),
    "eval option without eval": (["--eval-by-position"], r"--eval-by-position qualifies the evaluation during "
                                                         r"training, but --eval-every is 0 \(off\); add --eval-every"),
    "eval batches without eval": (["--eval-batches", "4"], r"--eval-batches qualifies the evaluation"),
    "passkey samples alone": (["--eval-every", "2", "--eval-passkey-samples", "3"],
                              r"--eval-passkey-samples \(3\) sets the passkey evaluation's samples, but "
                              r"--eval-passkey is not set"),
    "sft overlong on text": (["--sft-overlong", "drop"], r"--sft-overlong drop decides what happens to SFT records "
                                                         r"longer than a row, but --data-format is text"),
}


@pytest.mark.parametrize("name", list(TRAIN_ERRORS))
def test_train_bad_input_is_one_line_exit_2_nothing_written(name, tmp_path, capsys):
    if name == "wandb missing" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    _files(tmp_path)
    extra, pattern = TRAIN_ERRORS[name]
    extra = [a.replace("{d}", str(tmp_path)) for a in extra]
    run = tmp_path / "fresh"
    args = ["train", *TINY, "--steps", "1", "--run-dir", str(run), *extra]
    before = snapshot(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    import re

    assert re.search(pattern, err), err
    assert snapshot(tmp_path) == before and not run.exists()


def test_the_loop_refuses_a_row_beyond_the_bound_before_its_step(tmp_path, capsys, monkeypatch):
    """A row with more documents than cuDNN's packed attention was compiled for (the bound forced to 1 here: no CPU
    kernel has one) reaches the training loop: refused before its step, one line naming the flag, exit 2, nothing
    trained (no metrics line, no checkpoint)."""
    from ulysses_jax.train import run_loop, trainer

    for module in (trainer, run_loop):  # the setup's checks and the loop's
        monkeypatch.setattr(module, "documents_limit", lambda *a, **k: 1)
    corpus = tmp_path / "short.jsonl"  # documents of ~20 bytes: several in each 256-token row
    corpus.write_text("".join(json.dumps({"text": f"document {i} is short."}) + "\n" for i in range(80)))
    run = tmp_path / "run"
    assert main(["train", *TINY, *MESH, "--steps", "2", "--data", str(corpus), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: a row holds ") and (
        "more than --attn-max-documents 1 lets cuDNN's packed attention describe") in err, err
    assert not list(run.rglob("checkpoints/*/")) and not (run / "metrics.jsonl").read_text().strip()


def test_eval_bad_input(tmp_path, capsys):
    assert main(["eval", "--run-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "run.json not found" in err and "is not a training run directory" in err
    assert not (tmp_path / "nothing").exists()
    assert main(["eval"]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert main([]) == 2
    assert "no command given; use `ulysses-jax train`" in capsys.readouterr().err
    run = tmp_path / "half"
    run.mkdir()
    for content in ("{}", "not json"):
        (run / "run.json").write_text(content)
        assert main(["eval", "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "is not a readable ulysses-jax run record" in err
        assert len(err.splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]


def test_a_stray_file_named_like_a_step_is_no_checkpoint(tmp_path):
    """Checkpoints are folders: a file ``checkpoints/3`` does not make the run look three steps on (a review found
    "the run is at step 3 ... raise --steps" from one)."""
    from ulysses_jax.train.runconfig import inspect

    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "3").write_text("not a checkpoint")
    assert inspect(tmp_path).steps == (2,)
