"""The training loop's stop signals: SIGTERM / SIGINT end the run after the current step, with a checkpoint."""

from __future__ import annotations

import signal
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
