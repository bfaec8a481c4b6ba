"""The CLI: a 2-step pulse of the real entry point, resume after a kill, reshard on resume, eval, user errors."""

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

from ulysses_jax.cli import main

TINY = ["--preset", "tiny", "--seq-len", "256", "--no-progress"]


def cli(*args, check=True, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI picks its own fake devices
    proc = subprocess.run([sys.executable, "-m", "ulysses_jax", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def losses(run_dir):
    """step -> loss, the last record of each step (a resumed run appends)."""
    out = {}
    for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def test_pulse_train_then_eval(tmp_path):
    run = tmp_path / "run"
    p = cli("train", *TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "2",
            "--checkpoint-every", "1", "--optim.clip-norm", "0", "--run-dir", str(run))
    assert "No accelerator found: running on 8 fake CPU devices" in p.stdout
    assert f"checkpoints: {run / 'checkpoints'}" in p.stdout and "tensorboard --logdir" in p.stdout
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and all(np.isfinite(r["loss"]) for r in recs)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 0 for r in recs)
    assert sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit()) == [1, 2]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    e = cli("eval", "--run-dir", str(run), "--mesh.fsdp", "2", "--mesh.sp", "4", "--max-batches", "1")
    assert "eval at step 2: loss" in e.stdout and "perplexity" in e.stdout


def test_resume_after_kill_matches_uninterrupted(tmp_path):
    args = [*TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "10", "--checkpoint-every", "2"]
    cli("train", *args, "--run-dir", str(tmp_path / "straight"))
    want = losses(tmp_path / "straight")

    run = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "ulysses_jax", "train", *args, "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "training ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cli("train", *args, "--run-dir", str(run), "--resume")
    got = losses(run)
    assert sorted(got) == list(range(1, 11))
    for step in range(1, 11):  # deterministic on CPU: the same losses, bit for bit
        assert got[step] == want[step], (step, got[step], want[step])


def test_resume_onto_another_mesh(tmp_path):
    """Saved with fsdp=2 x sp=4, resumed with fsdp=4 x sp=2: training continues on the same trajectory."""
    args = [*TINY, "--batch-size", "4", "--steps", "4", "--checkpoint-every", "2"]
    cli("train", *args, "--mesh.fsdp", "2", "--mesh.sp", "4", "--run-dir", str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # back to the step-2 checkpoint (saved with sp=4)
    cli("train", *args, "--mesh.fsdp", "4", "--mesh.sp", "2", "--run-dir", str(tmp_path / "b"), "--resume")
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    for step in (3, 4):  # other mesh, other reduction order: equal to float32 rounding
        np.testing.assert_allclose(b[step], a[step], rtol=2e-5)


def snapshot(path: pathlib.Path):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")) if path.exists() else []


def make_run(tmp_path, name="run", extra=()):
    run = tmp_path / name
    assert main(["train", *TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "1",
                 "--run-dir", str(run), *extra]) == 0
    return run


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("cli"))


ERRORS = {
    "mesh": (["--mesh.fsdp", "3", "--mesh.sp", "2"], r"mesh sizes data=1 x fsdp=3 x sp=2 multiply to 6 but there are 8 devices"),
    "seq": (["--mesh.sp", "4", "--seq-len", "250"], r"--seq-len \(250\) must be a positive multiple of --mesh.sp \(4\)"),
    "batch": (["--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "3"], r"--batch-size \(3\) must be a multiple of"),
    "preset": (["--preset", "gpt5"], r"unknown preset 'gpt5'; choose one of"),
    "data": (["--data", "/no/such/file.txt"], r"/no/such/file.txt does not exist"),
    "resume-none": (["--resume"], r"--resume: no checkpoint in"),
    "chunk": (["--loss-chunk", "7"], r"--loss-chunk \(7\) must divide the per-device sequence length \(64 = seq / sp\)"),
    "cudnn": (["--attention", "cudnn"], r"impl='cudnn' cannot serve this call: cuDNN needs a GPU"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_user_errors_one_line_exit_2(name, tmp_path, capsys):
    extra, pattern = ERRORS[name]
    run = tmp_path / "fresh"
    args = ["train", *TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "1",
            "--run-dir", str(run)]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
    import re

    assert re.search(pattern, err), err
    assert not (run / "checkpoints").exists()


def test_run_dir_of_another_run_is_refused(existing_run, capsys):
    before = snapshot(existing_run)
    # same directory without --resume, and --resume with a different context length
    base = ["train", *TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "2",
            "--run-dir", str(existing_run)]
    assert main(base) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    assert main([*base, "--resume", "--seq-len", "512"]) == 2
    assert "holds another run's checkpoints (seq_len: saved 256, requested 512)" in capsys.readouterr().err
    assert snapshot(existing_run) == before


def test_corrupt_checkpoint_refused_without_traceback(tmp_path, capsys):
    run = make_run(tmp_path)
    for f in (run / "checkpoints" / "1" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size:
            f.write_bytes(b"not a checkpoint")
    before = snapshot(run)
    assert main(["train", *TINY, "--mesh.fsdp", "2", "--mesh.sp", "4", "--batch-size", "2", "--steps", "2",
                 "--run-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint") and "cannot be restored" in err and len(err.splitlines()) == 1
    assert snapshot(run) == before


def test_more_sp_than_heads_is_refused(tmp_path):
    p = cli("train", *TINY, "--cpu-devices", "16", "--mesh.fsdp", "1", "--mesh.sp", "16", "--seq-len", "256",
            "--batch-size", "1", "--steps", "1", "--run-dir", str(tmp_path / "r"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == ("error: --mesh.sp (16) exceeds the model's query heads (8): Ulysses splits heads "
                                "over sp; use --mesh.sp <= 8")


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    import jax.numpy as jnp

    from ulysses_jax.trainer import MeshConfig, TrainConfig, TrainingDiverged, setup_train, train_run

    cfg = TrainConfig(preset="tiny", seq_len=256, batch_size=2, steps=5, checkpoint_every=1, progress=False,
                      mesh=MeshConfig(fsdp=2, sp=4), run_dir=str(tmp_path / "run"))
    run = setup_train(cfg)
    real_step, calls = run.step_fn, []

    def poisoned(state, batch):  # the third step's loss is NaN
        state, metrics = real_step(state, batch)
        calls.append(1)
        return state, {**metrics, "loss": jnp.nan if len(calls) == 3 else metrics["loss"]}

    run.step_fn = poisoned
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3; stopped without saving \(last good checkpoint: step 2\)"):
        train_run(run)
    steps = sorted(int(d.name) for d in (tmp_path / "run" / "checkpoints").iterdir() if d.name.isdigit())
    assert steps == [1, 2]


def test_eval_errors(tmp_path, capsys):
    assert main(["eval", "--run-dir", str(tmp_path / "nothing"), "--mesh.fsdp", "2", "--mesh.sp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "run.json not found" in err and "is not a training run directory" in err
    run = tmp_path / "half"
    run.mkdir()
    for content in ("{}", "not json"):
        (run / "run.json").write_text(content)
        assert main(["eval", "--run-dir", str(run), "--mesh.fsdp", "2", "--mesh.sp", "4"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "is not a readable ulysses-jax run record" in err
        assert len(err.splitlines()) == 1
