"""The watchdog of a multi-process job: heartbeats in the coordination service, and a job that ends at once, with
one line, when a process is lost or fails (``train/cluster.py`` starts it).

A process that ends in error says so: ``failing`` (called where the error is caught: the training loop, the CLI's
one-line errors, ``peer_guard``, and ``sys.excepthook`` for the rest) puts ``failed/<process>`` with the error's first
line into the store at once, and ``end`` (the CLI's exit status) leaves without JAX's shutdown, whose barrier would wait
for peers stuck in a collective. Every other process reads the mark on its next heartbeat and exits with
``EXIT_PEER_LOST`` and one line naming the process and its error, unless it is ending in error itself (an error decided
for the whole job, ``decide_together``, ends every process alike). Only a clean exit (status 0, or 75: stopped by a
signal with a checkpoint saved, which every process does together) writes ``done/<process>``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time

EXIT_PEER_LOST = 69  # EX_UNAVAILABLE: another process of the job was lost or failed; restart the job with --resume
CLEAN_EXITS = (0, 75)  # done, or stopped by a signal after a checkpoint (every process stops after the same step)
_PREFIX = "ulysses_jax/cluster"


class Watchdog:
    """Heartbeats in the coordination service's key-value store; a silent or failed process stops the job (module
    doc). Marks under ``ulysses_jax/cluster/``: ``alive/<p>`` (the heartbeat), ``host/<p>``, ``lost`` (process 0's
    verdict), ``done/<p>`` (a clean exit), ``failed/<p>`` (an exit in error: its first line), ``left/<p>`` (stopped by
    another's loss or failure), ``gone/<p>`` (a failed process's last act)."""

    current: Watchdog | None = None

    def __init__(self, client, process_id: int, num_processes: int, timeout: float):
        self.client, self.me, self.n, self.timeout = client, process_id, num_processes, timeout
        self.interval = min(max(timeout / 10, 0.25), 5.0)
        # an error decided for the whole job (decide_together) reaches every process within moments: a peer's failure
        # mark is acted on only when this process has not failed alike meanwhile
        self.grace = min(2 * self.interval, 1.0)
        # failing, this process's cleanup may wait for a process that has left (a checkpoint's commit): ended after this
        self.linger = 2 * self.interval + 2
        self.resume_hint = ""  # the resume command, set once the run directory is known
        self.run_dir = None
        self.finishing = False  # this process is exiting normally: a failing store is no loss
        self.failing: str | None = None  # this process is ending in error: that error's first line
        self.code: int | None = None  # the exit status the CLI decided (None: not yet)
        self.lost: tuple[int, str] | None = None  # (process, why)
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[str, float]] = {}
        self._contact = time.monotonic()
        self._left_since: float | None = None  # failing: since when another process is known to have left

    @classmethod
    def start(cls, timeout: float) -> Watchdog:
        import jax
        from jax._src import distributed

        dog = cls(distributed.global_state.client, jax.process_index(), jax.process_count(), timeout)
        dog._set(f"host/{dog.me}", socket.gethostname())
        threading.Thread(target=dog._run, name="ulysses-watchdog", daemon=True).start()
        atexit.register(dog._at_exit)  # after JAX's own atexit (registered at import), so it runs before it
        previous = sys.excepthook

        def excepthook(kind, value, tb):  # an exception nothing caught: the process ends in error (status 1)
            dog.fail(describe(value))
            previous(kind, value, tb)

        sys.excepthook = excepthook
        cls.current = dog
        return dog

    def _set(self, key: str, value: str) -> None:
        self.client.key_value_set(f"{_PREFIX}/{key}", value, allow_overwrite=True)

    def _try_set(self, key: str, value: str, wait: float = 2.0) -> None:
        """``_set`` from a process on its way out: errors ignored, and given up after ``wait`` seconds (a call into a
        store whose host has gone can block for good)."""
        def put():
            with contextlib.suppress(Exception):
                self._set(key, value)

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        writer.join(wait)

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(f"{_PREFIX}/{key}")
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own error kinds; NOT_FOUND is "not yet"
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def _marked(self, kind: str) -> dict[int, str]:
        """``{process: value}`` of the ``kind/<process>`` marks in the store."""
        return {int(k.rpartition("/")[2]): v for k, v in self.client.key_value_dir_get(f"{_PREFIX}/{kind}/")}

    def finish(self) -> None:
        """This process ends normally: the others stop watching it."""
        self.finishing = True
        with contextlib.suppress(Exception):
            self._set(f"done/{self.me}", "1")

    def fail(self, line: str) -> None:
        """This process is ending in error: tell the others at once (module doc). The first call says why."""
        if self.failing is not None or self.finishing:
            return
        self.failing = " ".join(str(line).split())[:300] or "an error"
        self._try_set(f"failed/{self.me}", self.failing)

    def _at_exit(self) -> None:
        """Python exits: after an error (``fail``: an uncaught exception, status 1) leave at once; else finish."""
        if self.failing is not None:
            self.leave(1 if self.code is None else self.code)
        self.finish()

    def leave(self, code: int) -> None:
        """End this failed process with ``code``, without JAX's shutdown (its barrier waits for every process, and the
        others are leaving or stuck in a collective). Process 0 hosts the store that holds the failure mark: it first
        waits (``linger`` and two heartbeats at most) until every other process has gone, left or finished; the others
        leave at once (process 0 waits for them before it takes the store away, so that nothing aborts them first)."""
        self.code = code
        if self.me == 0:  # until each other process is gone: one failing too (an error decided for the whole job)
            # may still be on its way out, and the store's going would abort it there (a C++ stack, not its line)
            self._wait_until(lambda: set(range(1, self.n)) <= set().union(
                *(self._marked(kind) for kind in ("gone", "done", "left"))), self.linger + 2 * self.interval + 1)
        self._try_set(f"gone/{self.me}", str(code), wait=1.0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def leave_on_abort(self) -> None:
        """JAX's client aborts this failing process (the store's host left first): its own line if the CLI has not
        printed it yet, and its own status (1 when not decided yet)."""
        if self.code is None:
            print(f"error: {self.failing}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1 if self.code is None else self.code)

    @staticmethod
    def _wait_until(done, limit: float) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                if done():
                    return
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
                return
            time.sleep(0.05)

    def _run(self) -> None:
        beat = 0
        while True:
            now = time.monotonic()
            try:
                beat += 1
                self._set(f"alive/{self.me}", str(beat))
                self._watch(now)
                self._contact = now
            except Exception as e:  # noqa: BLE001 - the store is process 0's: failing, it is gone or unreachable
                if self.failing is not None:  # process 0 left after reading this one's failure
                    self._overdue(now, left=True)
                elif self.finishing:
                    return
                elif now - self._contact > self.timeout:
                    why = " ".join(str(e).split())[:100]
                    self.die(0, f"its coordination service has not answered for {now - self._contact:.0f} s ({why})")
            time.sleep(self.interval)

    def _overdue(self, now: float, left: bool) -> None:
        """Failing, this process waits for nothing a process that left could give: its main thread still busy
        ``linger`` seconds after one left (a collective or a checkpoint's commit waiting for it) is ended here, with the
        error's line."""
        if left and self._left_since is None:
            self._left_since = now
        if self._left_since is not None and now - self._left_since > self.linger:
            print(f"error: {self.failing} (process {self.me} stops {now - self._left_since:.0f} s after another "
                  f"process of the job left: its cleanup waited for it)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            code = 1 if self.code is None else self.code
            self._try_set(f"gone/{self.me}", str(code), wait=1.0)
            os._exit(code)

    def _watch(self, now: float) -> None:
        if self.failing is not None:  # the others stop on this process's mark: nothing to judge, only to wait for
            self._overdue(now, left=bool(self._marked("left")))
            return
        failed = {p: why for p, why in self._marked("failed").items() if p != self.me}
        if failed:
            p = min(failed)
            if not self.finishing:
                time.sleep(self.grace)  # an error decided for every process: this one's own exit comes first
            if self.failing is None:
                self.die(p, failed[p], failed=True)
            return
        if self.me != 0:  # process 0 watches everyone and says who is lost; the others watch process 0
            verdict = self._get("lost")
            if verdict is not None:
                who, _, why = verdict.partition(" ")
                self.die(int(who), why)
            peers = {0: self._get("alive/0")}
        else:
            found = dict(self.client.key_value_dir_get(f"{_PREFIX}/alive/"))
            peers = {p: found.get(f"{_PREFIX}/alive/{p}") for p in range(1, self.n)}
        for p, value in peers.items():
            last = self._seen.get(p)
            if last is None or last[0] != value:
                self._seen[p] = (value, now)
            elif now - last[1] > self.timeout and self._get(f"done/{p}") is None:
                why = f"no heartbeat for {now - last[1]:.0f} s (--peer-timeout {self.timeout:g})"
                if self.me == 0 and self.n > 2:  # the others (not the lost one) read the verdict while the store is up
                    with contextlib.suppress(Exception):
                        self._set("lost", f"{p} {why}")
                    time.sleep(2 * self.interval + 0.5)
                self.die(p, why)

    def confirm(self, wait: float) -> bool:
        """Whether a peer is lost, waiting up to ``wait`` seconds for the watchdog to find out (``die`` exits)."""
        time.sleep(wait)
        return False

    def die(self, process: int | None, why: str, failed: bool = False) -> None:
        """One line naming the lost (or ``failed``) process and the way on; exit ``EXIT_PEER_LOST`` at once (no
        atexit: JAX's shutdown would wait for the lost process). This process finished cleanly already: exit 0,
        quietly but for a note (JAX's shutdown barrier would wait for the failed one)."""
        with self._lock:
            host = None
            if process not in (None, self.me):
                with contextlib.suppress(Exception):
                    host = self._get(f"host/{process}") if process != 0 or self.me == 0 or failed else None
            where = f" on {host}" if host else ""
            role = " (the coordinator)" if process == 0 else ""
            who = "another process" if process is None else f"process {process} of {self.n}{role}{where}"
            if self.finishing:
                print(f"note: {who} {'failed' if failed else 'was lost'} after process {self.me} finished: {why}",
                      file=sys.stderr, flush=True)
            elif failed:
                print(f"error: {who} failed: {why}; process {self.me} stops too. Once the cause is fixed, "
                      f"{self._resume()[0].lower()}{self._resume()[1:]}", file=sys.stderr, flush=True)
            else:
                print(f"error: lost {who}: {why}; process {self.me} stops too. "
                      f"{self._resume()}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            if failed or process not in (0, None):  # the store is up (its host is not the one lost)
                self._try_set(f"left/{self.me}", "1", wait=1.0)
            if failed and self.me == 0 and process:  # the store is ours: the failed process leaves first (at most
                self._wait_until(lambda: self._get(f"gone/{process}") is not None,  # its linger, see _overdue)
                                 self.linger + 2 * self.interval + 1)
            os._exit(0 if self.finishing else EXIT_PEER_LOST)

    def _resume(self) -> str:
        if self.run_dir is None:
            return "Restart the job."
        from ulysses_jax.train import runconfig

        steps = runconfig.inspect(self.run_dir).steps
        last = f"from its last complete checkpoint, step {steps[-1]}" if steps else "from step 0 (no checkpoint yet)"
        return (f"Restart the job as it was launched, with --resume; it continues {last}: "
                f"ulysses-jax train --run-dir {self.run_dir} --resume")


def describe(error: BaseException) -> str:
    """The first line of ``error`` as its failure mark says it: a ``ValueError`` (a one-line user error) by its
    message, any other error with its type's name, as a traceback ends."""
    text = " ".join((str(error).strip().splitlines() or [""])[0].split())
    if isinstance(error, ValueError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def failing(error: BaseException | str) -> None:
    """This process is ending in ``error`` (an exception, or the line the CLI prints): tell the other processes of
    the job at once (``failed/<process>``; a no-op outside a multi-process job). A JAX runtime error may be a lost
    peer's doing (a collective that failed at once): ``peer_guard`` rules on it first."""
    dog = Watchdog.current
    if dog is None:
        return
    if isinstance(error, BaseException):
        import jax.errors

        if isinstance(error, jax.errors.JaxRuntimeError):
            return
        error = describe(error)
    dog.fail(error)


def end(code: int) -> None:
    """The CLI's exit status, in a multi-process job: a clean one (``CLEAN_EXITS``) says so and exits as usual; any
    other tells the other processes (if nothing has yet) and leaves now (``Watchdog.leave``)."""
    dog = Watchdog.current
    if dog is None:
        return
    if code in CLEAN_EXITS and dog.failing is None:
        dog.finish()
        return
    dog.fail(f"exit status {code}")
    dog.leave(code)


def set_run_dir(run_dir) -> None:
    """The run directory the lost-process line names (its last checkpoint, the resume command)."""
    if Watchdog.current is not None:
        Watchdog.current.run_dir = run_dir


@contextlib.contextmanager
def peer_guard():
    """An error in the main thread while another process is lost or failed (a collective that failed) ends like the
    watchdog's verdict: one line, ``EXIT_PEER_LOST``, no traceback. Any other error is this process's own: the others
    are told at once (``failing``) and it passes through."""
    try:
        yield
    except Exception as e:
        dog = Watchdog.current
        if dog is not None and not dog.finishing and dog.failing is None:
            import jax.errors

            if isinstance(e, jax.errors.JaxRuntimeError):  # maybe a peer's doing: exits if the watchdog finds one
                dog.confirm(dog.timeout + 4 * dog.interval + 5)
            dog.fail(describe(e))
        raise
