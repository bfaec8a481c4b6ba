"""The training loop's stop signals: SIGTERM / SIGINT end the run after the current step, with a checkpoint. Before
the loop (``stop_setup_at_once``) there is nothing to save: either signal ends the process at once, with one line."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import jax
import numpy as np


class _StopSignals:
    """SIGTERM / SIGINT set ``signum`` (the loop then saves and stops); a second one stops at once."""

    def __init__(self):
        self.signum, self._old = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            self.__exit__()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def stop(self) -> bool:
        stop = self.signum is not None
        if jax.process_count() > 1:  # every process stops after the same step (the save is collective)
            from jax.experimental import multihost_utils

            stop = bool(multihost_utils.process_allgather(np.int32(stop)).max())
        return stop


@contextlib.contextmanager
def stop_setup_at_once(what: str = "setting up the run"):
    """While ``what`` runs (reading data, building and compiling: minutes, mostly inside XLA, where a Python handler
    would wait for the compiler to return), a SIGTERM or SIGINT prints one line naming the signal and ends the process
    at once with status 128 + its number: a thread waits on the signal's wakeup byte, so the line comes even while the
    main thread is in C++. Nothing was trained yet; files are written whole (a temporary, then a rename), so none is
    left half-written. The previous handlers come back on exit. Outside the main thread: no effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait():
        got = os.read(read_fd, 1)
        if got:  # a signal (on exit the pipe closes: b"")
            name = signal.Signals(got[0]).name
            print(f"error: stopped by {name} while {what}, before the first step: nothing was trained or saved by "
                  f"this invocation; run the same command again to start it", file=sys.stderr, flush=True)
            os._exit(128 + got[0])

    thread = threading.Thread(target=wait, name="stop-setup", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for s, h in old.items():
            signal.signal(s, h)
        os.close(write_fd)  # the thread's read returns b"" and it ends
        thread.join()
        os.close(read_fd)
