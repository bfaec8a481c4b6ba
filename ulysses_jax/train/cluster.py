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

The watchdog itself, and how a process that fails ends the job: ``train/watchdog.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import time

from ulysses_jax.train.watchdog import (  # noqa: F401 (re-exported: the names of the job's end)
    CLEAN_EXITS,
    EXIT_PEER_LOST,
    Watchdog,
    describe,
    end,
    failing,
    peer_guard,
    set_run_dir,
)

DEFAULT_PEER_TIMEOUT = 60.0  # --peer-timeout: JAX's own heartbeat (which aborts) is set to 2x + 30 s, at least 100
SLURM_PORT_BASE = 65535 - 2**12 + 1  # JAX's: the port is SLURM_PORT_BASE + SLURM_JOB_ID mod 4096


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
    if Watchdog.current is not None:  # every process ends in this error at this moment: none reads another's as a loss
        Watchdog.current.fail(whys[0] + more)
    raise ValueError(whys[0] + more)
