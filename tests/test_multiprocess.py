"""Two processes on one machine (4 fake CPU devices each, gloo collectives) train, checkpoint and resume.

This is the multi-host code path: jax.distributed, per-process data loading, global arrays built from
process-local rows, Orbax checkpoints written by both processes, per-process data-iterator state.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

ARGS = ["--preset", "tiny", "--seq-len", "256", "--batch-size", "2", "--mesh.fsdp", "2", "--mesh.sp", "4",
        "--checkpoint-every", "1", "--cpu-devices", "4", "--no-progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(run_dir, steps, *extra):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ulysses_jax", "train", *ARGS, "--steps", str(steps), "--run-dir", str(run_dir),
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err[-3000:]}"
    return outs


def test_two_processes_train_and_resume(tmp_path):
    run = tmp_path / "run"
    outs = launch(run, 2)
    assert "running on 8 fake CPU devices" in outs[0][0]
    launch(run, 3, "--resume")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # process 0 writes the metrics
    # Orbax's JSON item (written by process 0 alone) holds both processes' iterator states
    data = json.loads((run / "checkpoints" / "3" / "data" / "metadata").read_text())
    assert sorted(data) == ["0", "1"] and data["0"]["process_index"] == 0 and data["1"]["process_index"] == 1


def test_partial_launch_flags_are_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "ulysses_jax", "train", *ARGS, "--run-dir", str(tmp_path / "r"),
                        "--num-processes", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: --coordinator-address, --num-processes and --process-id")


if sys.platform != "linux":
    pytestmark = pytest.mark.skip("gloo CPU collectives are tested on Linux only")
