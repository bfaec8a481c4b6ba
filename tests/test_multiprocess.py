"""Two processes on one machine (4 fake CPU devices each, gloo collectives) train, checkpoint and resume.

This is the multi-host code path: jax.distributed, per-process data loading, global arrays built from
process-local rows, Orbax checkpoints written by both processes, the data position of every global row; and a run
started on two processes continued on one.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

ARGS = ["--preset", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh.fsdp", "2", "--mesh.sp", "4",
        "--checkpoint-every", "1", "--cpu-devices", "4", "--attention", "xla", "--no-progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def launch(run_dir, steps, *extra):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ulysses_jax", "train", *ARGS, "--steps", str(steps), "--run-dir", str(run_dir),
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err[-3000:]}"
    return outs


def test_two_processes_train_resume_and_continue_on_one(tmp_path):
    """Two processes train 2 steps and resume to 3; one process (8 devices) continues to 4: the data position is kept
    per global row, so the run follows the trajectory of a single-process run."""
    run = tmp_path / "run"
    outs = launch(run, 2)
    assert "running on 8 fake CPU devices" in outs[0][0]
    launch(run, 3, "--resume")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # process 0 writes the metrics
    # Orbax's JSON item (written by process 0 alone) holds the position of every row of the global batch
    data = json.loads((run / "checkpoints" / "3" / "data" / "metadata").read_text())
    assert sorted(data["rows"]) == ["0", "1"] and data["global_batch"] == 2
    single = [sys.executable, "-m", "ulysses_jax", "train", "--cpu-devices", "8"]
    for args in (["--run-dir", str(run), "--resume", "--steps", "4"],
                 [*ARGS, "--cpu-devices", "8", "--steps", "4", "--optim.decay-steps", "2",  # the schedule the run began
                  "--run-dir", str(tmp_path / "straight")]):
        p = subprocess.run([*single, *args], capture_output=True, text=True, env=env(), timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got, want = ({r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}
                 for d in (run, tmp_path / "straight"))
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):  # other processes, other reduction order: equal to float32 rounding
        assert abs(got[step] - want[step]) <= 2e-5 * abs(want[step]), (step, got[step], want[step])


def test_partial_launch_flags_are_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", "train", *ARGS, "--run-dir", str(tmp_path / "r"),
                        "--num-processes", "2"], capture_output=True, text=True, env=env(), timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: --coordinator-address, --num-processes and --process-id")


if sys.platform != "linux":
    pytestmark = pytest.mark.skip("gloo CPU collectives are tested on Linux only")


def test_ring_across_two_processes_equals_one(tmp_path):
    """ring=2 x sp=4 with 4 devices per process: each row's sequence is split between the processes, which read the
    same rows (data.process_rows) and give their devices their half; the losses are those of one 8-device process."""
    ring = ["--preset", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh.fsdp", "1", "--mesh.ring", "2",
            "--mesh.sp", "4", "--attention", "xla", "--no-progress", "--steps", "2"]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ulysses_jax", "train", *ring, "--cpu-devices", "4", "--run-dir",
             str(tmp_path / "two"), "--coordinator-address", f"localhost:{port}", "--num-processes", "2",
             "--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        for i in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err[-3000:]}"
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", "train", *ring, "--cpu-devices", "8", "--run-dir",
                        str(tmp_path / "one")], capture_output=True, text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got, want = ({r["step"]: r["loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())}
                 for d in ("two", "one"))
    assert sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        assert abs(got[step] - want[step]) <= 2e-5 * abs(want[step]), (step, got[step], want[step])


def test_eval_on_two_processes_equals_one(tmp_path):
    """`eval --by-position --task passkey` with 2 processes x 4 devices (each process reads its rows, the scores are
    gathered) gives the numbers of one 8-device process: the loss, every position bucket, every passkey cell."""
    run = tmp_path / "run"
    train = [sys.executable, "-m", "ulysses_jax", "train", *ARGS, "--cpu-devices", "8", "--steps", "2",
             "--run-dir", str(run)]
    p = subprocess.run(train, capture_output=True, text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    ev = ["eval", "--run-dir", str(run), "--by-position", "--task", "passkey", "--steps", "1,last", "--samples", "2",
          "--max-batches", "2", "--no-plot", "--mesh.fsdp", "2", "--mesh.sp", "4"]

    def results():
        pos = json.loads((run / "eval_by_position.json").read_text())
        pk = json.loads((run / "eval_passkey.json").read_text())
        loss = [json.loads(x)["loss"] for x in (run / "eval.jsonl").read_text().splitlines()][-2:]
        return pos, pk, loss

    p = subprocess.run([sys.executable, "-m", "ulysses_jax", *ev, "--cpu-devices", "8"], capture_output=True,
                       text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    one = results()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "ulysses_jax", *ev, "--cpu-devices", "4", "--coordinator-address",
                               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()) for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-3000:]}"
    two = results()
    (pos1, pk1, loss1), (pos2, pk2, loss2) = one, two
    assert loss2 == pytest.approx(loss1, rel=2e-5)
    assert [s["step"] for s in pos2["steps"]] == [s["step"] for s in pos1["steps"]] == [1, 2]
    for b1, b2 in zip(pos1["buckets"], pos2["buckets"]):
        assert (b1["start"], b1["end"], b1["tokens"]) == (b2["start"], b2["end"], b2["tokens"])
        assert (b1["loss"] is None and b2["loss"] is None) or b2["loss"] == pytest.approx(b1["loss"], rel=2e-5)
    cells = lambda pk: [(r["step"], r["length"], r["depth"], r["samples"], r["accuracy"]) for r in pk["results"]]  # noqa: E731
    assert cells(pk2) == cells(pk1) and {r["step"] for r in pk1["results"]} == {1, 2}
    assert [r["key_token_accuracy"] for r in pk2["results"]] == pytest.approx(
        [r["key_token_accuracy"] for r in pk1["results"]])
