"""A SIGTERM or SIGINT before the first step (reading data, building, compiling): one line naming it, exit 128 +
its number at once, even while the main thread is inside a C++ call; after setup the handlers are as before."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ulysses_jax.train.signals import stop_setup_at_once

# the main thread blocks in a C call that releases the GIL (as XLA's compiler does): os.read on a pipe nobody writes
SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from ulysses_jax.train.signals import stop_setup_at_once
    with stop_setup_at_once("testing the guard"):
        os.kill(os.getpid(), signal.{name})
        os.read(os.pipe()[0], 1)
    print("not reached")
""")


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_in_setup_ends_the_process_with_one_line(name, code):
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(name=name)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "not reached" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: stopped by {name} while testing the guard, before the first step: nothing was trained "
                     f"or saved by this invocation; run the same command again to start it"], proc.stderr


def test_the_handlers_come_back_after_setup():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with stop_setup_at_once():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before
    previous = signal.set_wakeup_fd(-1)
    assert previous == -1  # no wakeup fd left behind
    signal.set_wakeup_fd(previous)


def test_train_stopped_in_setup_says_so(tmp_path):
    """The CLI: a SIGTERM after the device line (inside the guard), while the run is still being set up."""
    # unbuffered: the device line reaches the pipe when printed (block-buffered, it would come at exit)
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ulysses_jax", "train", "--preset", "tiny", "--seq-len", "256",
                             "--steps", "2", "--no-progress", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    first = proc.stdout.readline()  # _setup_devices' line, printed inside the guard before the run is built
    assert "fake CPU devices" in first or "Running on" in first, first
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, first + out + err
    assert "error: stopped by SIGTERM while setting up the run, before the first step" in err, err
    assert "Traceback" not in err and "Training" not in out
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
