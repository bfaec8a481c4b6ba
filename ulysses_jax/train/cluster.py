"""Several processes as a scheduler starts them: who is who, and a job that ends cleanly when one of them is lost.

``launch_settings(environ)`` reads what SLURM (``srun``) or a Kubernetes Indexed Job gives each process and returns
the coordinator's address, the process count and this process's index (``None`` outside a scheduler):

* SLURM: ``SLURM_JOB_ID`` (the coordinator's port: ``61440 + job id mod 4096``, JAX's choice, unless
  ``JAX_COORDINATOR_PORT`` names one), ``SLURM_STEP_NODELIST`` (its first node is the coordinator; falls back to
  ``SLURM_JOB_NODELIST``), ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``
  (one task per node: the task takes every GPU of its node; several: one GPU each, the ``SLURM_LOCALID``-th).
* Kubernetes (``experiments/launch/k8s-indexed-job.yaml``): ``JAX_COORDINATOR_ADDRESS`` (host:port of index 0, set by
  the manifest), ``JAX_NUM_PROCESSES`` (set by the manifest), ``JOB_COMPLETION_INDEX`` (set by Kubernetes for an
  Indexed Job; ``JAX_PROCESS_ID`` wins if given).

``initialize`` calls ``jax.distributed.initialize`` with those values (JAX's own detection off, so a one-task-per-node
SLURM job is not cut to one GPU a node; outside both, JAX's detection: Open MPI, mpi4py) and starts the
``Watchdog``: each process posts a heartbeat into the coordination service's key-value store every
``--peer-timeout / 10`` seconds (0.25 to 5); process 0 watches every heartbeat, the others watch process 0's and its
verdict. A process silent for ``--peer-timeout`` seconds is lost: every other process prints one
line naming it and the resume command, and exits with ``EXIT_PEER_LOST`` (no hang, no C++ abort: JAX's own heartbeat,
which aborts with a stack trace, is set to fire later). ``peer_guard`` does the same for an error the lost peer causes
in the main thread (a collective that fails at once, as gloo's does on CPU).

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
import dataclasses
import os
import re
import socket
import sys
import threading
import time

DEFAULT_PEER_TIMEOUT = 60.0  # --peer-timeout: JAX's own heartbeat (which aborts) is set to 2x + 30 s, at least 100
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE: another process of the job was lost or failed; restart the job with --resume
CLEAN_EXITS = (0, 75)  # done, or stopped by a signal after a checkpoint (every process stops after the same step)
SLURM_PORT_BASE = 65535 - 2**12 + 1  # JAX's: the port is SLURM_PORT_BASE + SLURM_JOB_ID mod 4096
_PREFIX = "ulysses_jax/cluster"


@dataclasses.dataclass(frozen=True)
class Launch:
    coordinator: str  # host:port of process 0
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device of the node
    source: str  # "SLURM" or "Kubernetes"


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-010,012],io1`` -> ``gpu003``."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ValueError(f"SLURM_STEP_NODELIST {nodelist!r} names no node")
    return m.group(1) + (m.group(2) or "")


def _tasks_per_node(spec: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    out = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE {spec!r} is not a SLURM task count such as 1(x4)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} in the environment is not an integer") from None


def launch_settings(environ) -> Launch | None:
    """Who this process is in the job its scheduler started (module doc); None outside SLURM and Kubernetes."""
    slurm = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in environ for k in slurm):
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ValueError("SLURM_STEP_NODELIST is not set: start each task with srun (inside sbatch or salloc)")
        port = environ.get("JAX_COORDINATOR_PORT") or str(SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % 2**12)
        per_node = _tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE")
                                   or environ.get("SLURM_TASKS_PER_NODE") or "1")
        local = None if max(per_node) == 1 else (_int(environ, "SLURM_LOCALID"),)
        return Launch(f"{first_node(nodes)}:{port}", _int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_PROCID"),
                      local, "SLURM")
    index = environ.get("JAX_PROCESS_ID", environ.get("JOB_COMPLETION_INDEX"))
    if index is not None and "JAX_COORDINATOR_ADDRESS" in environ:
        if "JAX_NUM_PROCESSES" not in environ:
            raise ValueError("JAX_COORDINATOR_ADDRESS and JOB_COMPLETION_INDEX are set but JAX_NUM_PROCESSES is not: "
                             "set it to the Job's completions (experiments/launch/k8s-indexed-job.yaml)")
        name = "JAX_PROCESS_ID" if "JAX_PROCESS_ID" in environ else "JOB_COMPLETION_INDEX"
        return Launch(environ["JAX_COORDINATOR_ADDRESS"], _int(environ, "JAX_NUM_PROCESSES"), _int(environ, name),
                      None, "Kubernetes")
    return None


def check_peer_timeout(seconds: float) -> float:
    if not seconds >= 2:
        raise ValueError(f"--peer-timeout ({seconds}) must be at least 2 seconds: how long a silent process is "
                         f"waited for before every process stops")
    return seconds


def initialize(*, distributed: bool, coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, peer_timeout: float, run_dir=None, environ=os.environ) -> str | None:
    """``jax.distributed.initialize`` for ``--distributed`` or the explicit flags, then the watchdog; returns what the
    launch was read from (a phrase for the start line) or None for a single process."""
    import jax

    if not distributed and coordinator_address is None:
        return None
    check_peer_timeout(peer_timeout)
    heartbeat = int(max(100, 2 * peer_timeout + 30))  # JAX's own, which aborts with a C++ stack trace: after ours
    launch = (Launch(coordinator_address, num_processes, process_id, None, "--coordinator-address")
              if coordinator_address is not None else launch_settings(environ))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only: lets fake devices talk
    if launch is None:  # not SLURM nor our Kubernetes variables: JAX's own detection (Open MPI, mpi4py, ...)
        try:
            with _service_errors_to_watchdog():
                jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        except ValueError:
            raise ValueError(NO_SCHEDULER) from None
        from jax._src import distributed as state

        launch = Launch(state.global_state.coordinator_address, jax.process_count(), jax.process_index(), None,
                        "JAX's cluster detection")
    else:
        if not 0 <= launch.process_id < launch.num_processes:
            raise ValueError(f"process index {launch.process_id} (from {launch.source}) is not within the "
                             f"{launch.num_processes} processes of the job")
        with _service_errors_to_watchdog():
            jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                                       local_device_ids=list(launch.local_device_ids or ()) or None,
                                       cluster_detection_method="deactivate", heartbeat_timeout_seconds=heartbeat)
    dog = Watchdog.start(peer_timeout)
    dog.run_dir = run_dir
    if launch.process_id != 0:
        _abort_to_line(dog, launch.coordinator)
    return (f"process {launch.process_id} of {launch.num_processes} ({launch.source}; coordinator "
            f"{launch.coordinator})")


NO_SCHEDULER = ("--distributed: no SLURM task (SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID), no Kubernetes "
                "index (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JOB_COMPLETION_INDEX) and no cluster JAX detects "
                "in the environment; start it with srun or the Indexed Job of experiments/launch/, or give "
                "--coordinator-address, --num-processes and --process-id")


@contextlib.contextmanager
def _service_errors_to_watchdog():
    """JAX's client terminates the process (a C++ check failure, SIGABRT) the moment the coordination service reports
    an error, e.g. at once when process 0, which hosts the service, dies. The client takes a callback for that
    instead (``missed_heartbeat_callback``; ``jax.distributed.initialize`` does not pass one): hand it ours while
    ``initialize`` builds the client. A JAX without that hook keeps its own behaviour."""
    from jax._src import distributed

    real = distributed._jax

    class Lib:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_client(*args, **kwargs):
            kwargs.setdefault("missed_heartbeat_callback", _service_error)
            return real.get_distributed_runtime_client(*args, **kwargs)

    hooked = "missed_heartbeat_callback" in (real.get_distributed_runtime_client.__doc__ or "")
    distributed._jax = Lib() if hooked else real
    try:
        yield
    finally:
        distributed._jax = real


def _service_error(status=None, *_) -> None:
    """The coordination service reported an error (module doc): a lost process, named when the error names it."""
    text = " ".join(str(status).split())
    dog = Watchdog.current
    if dog is None or dog.finishing:
        return
    if dog.failing is not None:
        dog.leave_on_abort()
    task = re.search(r"[Tt]ask (\d+) heartbeat timeout", text)
    if task:
        dog.die(int(task.group(1)), "the coordination service missed its heartbeat")
    if dog.me != 0:
        dog.die(0, f"the coordination service it hosts stopped answering ({text[:100]})")
    dog.die(None, f"the coordination service reported: {text[:160]}")


def _abort_to_line(dog: Watchdog, coordinator: str) -> None:
    """When process 0 dies, JAX's client aborts this process at once (SIGABRT), whatever callback it was given: the
    one of jaxlib 0.10.2 cannot be called (its status has no Python form: ``std::bad_cast``). A C-level SIGABRT
    handler turns that abort into the watchdog's line and exit status, when the coordinator's port is closed; any
    other abort goes on as before (the handler returns, ``abort`` re-raises with the default action)."""
    import ctypes
    import signal

    host, _, port = coordinator.rpartition(":")
    libc = ctypes.CDLL(None, use_errno=True)
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, handler_type], ctypes.c_void_p

    def on_abort(signum):
        if dog.failing is not None:  # ending in error already: the coordinator left first; keep our own status
            dog.leave_on_abort()
        if not dog.finishing:
            for _ in range(6):  # a process killed a moment ago may still hold its port open: look again, ~2 s
                try:
                    socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
                except OSError:
                    dog.die(0, "its coordination service closed: the process or its node is gone")
                time.sleep(0.4)
        libc.signal(signal.SIGABRT, handler_type(0))  # SIG_DFL: abort() goes on as it would have

    dog.abort_handler = handler_type(on_abort)  # kept alive as long as the watchdog
    libc.signal(signal.SIGABRT, dog.abort_handler)


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
        waits (a few heartbeats at most) until every other process has read it; the others leave at once (process 0
        waits for them before it takes the store away, so that nothing aborts them first)."""
        self.code = code
        if self.me == 0:
            self._wait_until(lambda: set(range(1, self.n)) <= set().union(
                *(self._marked(kind) for kind in ("failed", "done", "left"))), self.interval + self.grace + 2)
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


def decide_together(check, *args, rows=None) -> None:
    """``check(*args)`` (which raises ``ValueError`` to refuse) on this process's part of a batch, decided for the whole
    job: when it refuses on any process, every process raises the same ``ValueError``, naming the first process that
    refused and ``rows`` (its rows of the global batch), so that no process goes on into a collective that a refusing
    peer has left. One process: ``check`` alone. Every process must call it (a collective)."""
    import jax

    if jax.process_count() == 1:
        check(*args)
        return
    import numpy as np
    from jax.experimental import multihost_utils

    try:
        check(*args)
        why = ""
    except ValueError as e:
        where = f"process {jax.process_index()} of {jax.process_count()}"
        where += f" (rows {', '.join(map(str, rows))} of the global batch)" if rows is not None else ""
        why = f"{where}: {' '.join(str(e).split())}"
    refused = np.asarray(multihost_utils.process_allgather(np.int32(bool(why)))).reshape(-1)
    if not refused.any():
        return
    from ulysses_jax.train.checkpoint import gather

    whys = [w for w in gather(why) if w]
    more = f" (and on {len(whys) - 1} more process{'es' if len(whys) > 2 else ''})" if len(whys) > 1 else ""
    raise ValueError(whys[0] + more)


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
