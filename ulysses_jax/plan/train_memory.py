"""``train --memory auto`` (the default): the memory tools a run takes when it is given none, chosen as
``plan --memory auto`` chooses them for a ``--seq-len``.

On an H100 or H200, a new run given no memory flag (``train.config.MEMORY_SETTINGS``) compiles its step with each set
of ``search.memory_choices`` for compile-only GPUs of its own kind, with its own model, mesh, batch and length
(``search.auto_fit``), and trains with the set of the shortest estimated step (``estimate.py``; of those within 2% of
it, the fastest that needs at most 75% of the device budget and no host memory, or where none does the one needing the
least memory; on one GPU the pick is tried with the layer loop unrolled too) among those within both
budgets: XLA's buffers within 0.9 of the device (scaled with the memory pool where ``--memory-fraction`` or the
environment changes it), pinned host memory within 90% of this machine's memory over its GPUs. One line says what it
picked and why; each set's figures go to a log file that line names.

Nothing is searched (the flags stay as given) with ``--memory manual``, when any memory flag is given (the user's
choice wins; one line says so on a GPU), on CPU devices (the fake-device default run: the compiles would cost more than
the run), on a GPU that has no compile-only target here, and on resume (the run keeps the tools it recorded). When no
set fits, ``NothingFits`` names the fix in one sentence (``ulysses-jax train`` exits 1, as ``plan`` does).

``memory_setup(given)`` (``choose_memory`` with the settings the flags give) is what ``ulysses-jax train`` hands
``setup_train``: the planning layer sits above the training one. ``decide`` is its logic with the job and the search
given, which the tests call without compiling.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax

from ulysses_jax.kernels.attention import device_platform
from ulysses_jax.plan import xla_log
from ulysses_jax.plan.planner import PlanConfig, budgets
from ulysses_jax.plan.report import GiB, seconds
from ulysses_jax.plan.search import NEAR, ROOMY, NothingFits, auto_fit
from ulysses_jax.plan.targets import HOST_SHARE, TARGETS, get_target
from ulysses_jax.train.checkpoint import gather
from ulysses_jax.train.config import TrainConfig, memory_flags_given
from ulysses_jax.train.devices import DEFAULT_MEMORY_FRACTION, MeshConfig, check_memory_fraction, memory_pool

WHY = ("--memory auto: the shortest estimated step of the sets of memory tools that fit (within 2% of it, the least "
       "memory where none needs at most 75% of the device budget and no host memory)")  # run.json's defaults


@dataclasses.dataclass(frozen=True)
class Job:
    """What the search needs of the devices a run trains on."""

    platform: str  # "gpu", "cpu", ...
    device_kind: str  # jax.Device.device_kind
    devices: int
    hosts: int
    mesh: dict[str, int]  # the resolved mesh's shape
    batch_size: int  # rows per step, resolved
    memory_fraction: float  # the share of each GPU JAX's pool takes (the environment's, where it sets one)
    host_memory_gib: float | None  # pinned host memory per GPU the search may plan; None: the target node's share


def target_for(device_kind: str) -> str | None:
    """The compile-only target of a GPU of ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``), or None."""
    words = device_kind.upper().replace("-", " ").split()
    return next((name for name in TARGETS if name.upper() in words), None)


def host_memory_gib(local_devices: int) -> float | None:
    """``HOST_SHARE`` of this machine's memory over its GPUs, in GiB (None where the OS does not say)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return HOST_SHARE * total / max(local_devices, 1) / GiB


def job_of(cfg: TrainConfig, mesh, batch_size: int) -> Job:
    """The ``Job`` of a run on ``mesh`` (this process's view; every process of a job sees the same)."""
    local = jax.local_device_count()
    kind = mesh.devices.flat[0].device_kind
    target = target_for(kind)
    per_host = TARGETS[target].gpus_per_host if target else 8
    # processes of several GPUs: one a host; of one GPU each: as many to a host as the target's node holds
    hosts = jax.process_count() if local > 1 else max(1, -(-mesh.devices.size // per_host))
    hosts = hosts if mesh.devices.size % hosts == 0 else 1
    return Job(platform=device_platform(mesh), device_kind=kind, devices=mesh.devices.size, hosts=hosts,
               mesh=dict(mesh.shape), batch_size=batch_size,
               memory_fraction=memory_pool(cfg.memory_fraction, os.environ)[0],
               host_memory_gib=host_memory_gib(max(1, mesh.devices.size // hosts)))  # the host GPUs, not ours


def plan_config(cfg: TrainConfig, job: Job, target: str) -> PlanConfig:
    """The ``plan --memory auto`` of ``cfg`` on ``job``'s devices: its mesh and batch as resolved, the device budget
    plan's default (0.9) scaled with the pool (0.95 by default), the host budget this machine's."""
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    budget = min(PlanConfig.budget_fraction * job.memory_fraction / DEFAULT_MEMORY_FRACTION,
                 check_memory_fraction(cfg.memory_fraction))
    settings.update(memory="auto", batch_size=job.batch_size, mesh=MeshConfig(**{a: job.mesh.get(a, 1) for a in (
        "data", "fsdp", "ring", "sp")}))
    return PlanConfig(**settings, target=target, devices=job.devices, hosts=job.hosts, budget_fraction=budget,
                      host_memory_gib=job.host_memory_gib, kernels=False)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _agree(outcome: str) -> None:
    """Every process of a job searched alike (the same programs compiled the same way): one that did not is refused
    on all of them, naming process 0's outcome, before any of them builds another program."""
    every = gather(outcome)
    if len(set(every)) > 1:
        raise ValueError(f"--memory auto came to other memory tools on other processes ({every[0]!r} on process 0, "
                         f"{next(o for o in every if o != every[0])!r} on another); give process 0's flags to train")


def _appending(path: str | None):
    """A ``log`` that appends each line to the file ``path`` (None: drops them)."""
    def log(line: str) -> None:
        if path is not None:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    return log


def decide(cfg: TrainConfig, job: Job, *, given: set[str] | frozenset[str] = frozenset(), search=auto_fit, log=print,
           log_file: bool = True, agree=_agree) -> tuple[TrainConfig, str | None]:
    """``(the config to train, why its memory tools are what they are)`` (module doc); the why is None where the
    flags stay as given. ``given``: the settings the user's flags and ``--config`` file give
    (``runconfig.given_settings``). ``search(plan_config, log=, detail=False)``: ``search.auto_fit`` or a stand-in.
    Lines go to ``log``: one before a search (it takes a compile per set) and one after; with ``log_file`` the
    search's own lines (each set's memory and estimate) and XLA's compiler messages go to a file they name. Raises
    ``NothingFits`` when no set fits."""
    if cfg.memory == "manual" or job.platform != "gpu":
        return cfg, None
    flags = memory_flags_given(cfg, given)
    if flags:
        log(f"memory: the flags given ({', '.join(flags)}); --memory auto searches only when no memory flag is given")
        return cfg, None
    target = target_for(job.device_kind)
    if target is None:
        log(f"memory: the preset's tools, no search (plan compiles for {' and '.join(t.upper() for t in TARGETS)} "
            f"only, not {job.device_kind}); memory flags change them, --memory manual drops this line")
        return cfg, None
    # the layer loop unrolled where it fits and is faster (search.unrollable), unless --scan-unroll or
    # --no-scan-unroll is given
    pcfg = dataclasses.replace(plan_config(cfg, job, target), memory_unroll="scan_unroll" not in given)
    _, device_budget, host_budget, _ = budgets(pcfg, get_target(target))
    on = f"{job.devices} {target.upper()}{'s' if job.devices > 1 else ''}"
    log(f"memory: no memory flag given (--memory auto): compiling the step with each set of memory tools `plan "
        f"--memory auto` tries, for {on}, to train with the fastest that fits (--memory manual skips this)")
    t0 = time.perf_counter()
    path = xla_log.default_path() if log_file else None
    p = failed = None
    try:
        with xla_log.stderr_to(path):  # XLA's C++ messages into the file, beside the search's lines
            p = search(pcfg, log=_appending(path), detail=False)
        outcome = p.memory_flags
    except NothingFits:
        outcome = "none fits"
    except Exception as e:  # noqa: BLE001 - a set XLA cannot compile, no CUDA plugin, a topology it cannot make:
        failed = " ".join(str(e).split())[:200]  # no choice to make, and no reason to stop a run that may fit as given
        outcome = "failed"
    agree(outcome)
    if failed is not None:
        log(f"memory: the preset's tools, the search failed ({failed}); give memory flags, or --memory manual")
        return cfg, None
    where = f", each in {path}" if path else ""
    if p is None:
        raise NothingFits(
            f"no set of memory tools fits --seq-len {cfg.seq_len} with batch {job.batch_size} on these {on} within "
            f"{_gib(device_budget)} per device and {_gib(host_budget)} of host memory per GPU (--memory auto compiled "
            f"each set{where}); train on more GPUs or at a shorter --seq-len (`ulysses-jax plan` with this run's "
            f"flags and --memory auto --find-max-seq-len finds the longest that fits)")
    picked = dataclasses.replace(cfg, **p.memory_changes)
    fit = [a for a in p.alternatives if a["fits"] and a["step_seconds"] is not None]
    compiled = 1 + sum(a["fits"] is not None for a in p.alternatives)
    other, nxt = min((a["step_seconds"] for a in fit), default=None), ""
    if other is not None and other >= p.estimate["step_seconds"]:
        nxt = f"; the next fastest {seconds(other)}"
    elif other is not None:  # faster by less than NEAR, in more memory near the budget (search._fastest)
        nxt = f"; the fastest {seconds(other)}, within {NEAR:.0%} of it in more memory"
    log(f"memory: {p.memory_flags} (--memory auto, no memory flag given: the shortest estimated step (within "
        f"{NEAR:.0%}, the least memory where none needs at most {ROOMY:.0%} of the budget and no host memory), "
        f"{seconds(p.estimate['step_seconds'])}, of the {len(fit) + 1} set{'s' if fit else ''} that fit "
        f"{_gib(p.memory['budget_bytes'])} per {target.upper()} and {_gib(p.memory['host_budget_bytes'])} of host "
        f"memory per GPU{nxt}; {compiled} compiled in {time.perf_counter() - t0:.0f} s{where}; --memory manual keeps "
        f"the preset's)")
    return picked, WHY


def choose_memory(cfg: TrainConfig, *, mesh, batch_size: int, given: set[str] | frozenset[str] = frozenset(),
                  log=print) -> tuple[TrainConfig, str | None]:
    """``decide`` for a new run on ``mesh`` (``setup_train``'s ``memory_setup``; the CLI binds ``given``)."""
    if cfg.memory == "manual":
        return cfg, None
    return decide(cfg, job_of(cfg, mesh, batch_size), given=given, log=log)


def memory_setup(given: set[str] | frozenset[str] = frozenset()):
    """``setup_train``'s ``memory_setup`` for a command whose flags give ``given``."""
    return functools.partial(choose_memory, given=given)
