"""``ulysses-jax plan``: will this model, at this context, fit on these GPUs, and what does a step cost?

``plan(PlanConfig(...))`` compiles the *real* training step of ``ulysses-jax train`` (the same ``TrainConfig`` gives
the model, mesh, optimizer, step function with its shardings, donation, gradient accumulation and memory tools)
for compile-only GPUs (``ulysses_jax.plan.targets``) on abstract arrays: nothing is allocated and no data is read.

Memory per device comes from XLA's buffer assignment (``compiled.memory_analysis()``): ``argument`` (train state
and batch), ``output`` (new state, metrics), ``temp`` (activations, gradients, workspaces), ``alias`` (outputs
written into the donated state). ``total = argument + output + temp - alias``. XLA's figure leaves out the CUDA
context (about 0.5 GiB), NCCL's buffers, cuBLAS workspaces and allocator fragmentation, so a plan *fits* when the
total is within ``budget_fraction`` (default 0.9) of the device's memory: 7.9 GiB of margin on an H100. JAX
preallocates 75% of the memory by default; run with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` so that the pool
holds the budget, leaving 5% of the device for the context and NCCL outside the pool.

Of the total, ``parameters`` and ``optimizer`` are exact (the state's shards on one device); ``gradients`` is one
parameter shard's worth, an estimate of what the step holds at the end of the backward inside ``temp``;
``activations`` is the rest of ``temp``. Collectives come from the GPU HLO (``ulysses_jax.plan.hlo``: the layer loop
counted once per layer). Model FLOPs and the time they need at the device's dense bf16 peak give a *floor* of the
step time, not a prediction; link bandwidths likewise give a floor for the collectives if nothing overlapped.
Pallas kernels are listed with ptxas's registers and spills (``ulysses_jax.plan.kernel_report``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import tempfile
import time
from typing import Literal

import jax
import jax.numpy as jnp

from ulysses_jax.data.tokenizers import make_tokenizer
from ulysses_jax.model import flops
from ulysses_jax.plan import hlo
from ulysses_jax.plan.kernel_report import KernelInfo, dump_options, kernels
from ulysses_jax.plan.report import GiB, format_plan, gib
from ulysses_jax.plan.targets import GpuTarget, get_target, target_devices
from ulysses_jax.train.config import TrainConfig, model_config
from ulysses_jax.train.devices import MeshConfig, build_mesh, check_parallel, resolve_batch
from ulysses_jax.train.step import (
    BATCH_KEYS,
    abstract_state,
    batch_sharding,
    check_offload_params,
    make_optimizer,
    make_schedule,
    make_train_step,
)
from ulysses_jax.train.trainer import device_total_bytes

MAX_SEQ_LEN = 2**28  # the search for the longest context stops here (268M tokens)


@dataclasses.dataclass(frozen=True)
class PlanConfig(TrainConfig):
    """``ulysses-jax plan``: every ``train`` flag (run, data and process flags are ignored), plus the target."""

    target: str = "h100"  # compile-only GPU: h100 (SXM 80 GB) or h200 (141 GB)
    devices: int = 8  # GPUs in the planned job
    hosts: int = 1  # hosts they are spread over (devices / hosts GPUs each)
    budget_fraction: float = 0.9  # share of device memory XLA's buffers may use (the rest: CUDA, NCCL, fragmentation)
    find_max_seq_len: bool = False  # search for the longest --seq-len that fits, and plan it
    memory: Literal["manual", "auto"] = "manual"
    """auto: try the sets of memory tools (remat full, every k-th layer, offload with the optimizer in host memory,
    every 2nd layer, the tiled attention in head groups) in that order of cost and print the train flags: the first
    that fits --seq-len, or with --find-max-seq-len the one with the longest context; host memory within
    --host-memory-gib"""
    host_memory_gib: float = 237.0  # pinned host memory per GPU that --memory auto may plan for (1.9 TB / 8)
    json: str | None = None  # also write the plan as JSON to this file
    kernels: bool = True  # read registers and spills of the Pallas kernels with ptxas (needs the PTX dump)
    xla_log: str | None = None
    """file for XLA's own compiler messages (buffer assignment, rematerialization); None: a new file in the temp
    directory, named at the end; -: show them on the terminal (ulysses_jax.plan.xla_log)"""


@dataclasses.dataclass
class Plan:
    target: GpuTarget
    num_devices: int
    hosts: int
    mesh: dict[str, int]
    model: str
    seq_len: int
    batch_size: int
    memory: dict[str, int]  # XLA's per-device figures plus total and budget
    breakdown: dict[str, int]  # parameters, optimizer, gradients (estimate), batch, activations
    collectives: dict[str, hlo.Collective]
    flops_per_step: float
    kernels: list[KernelInfo]
    compile_seconds: float
    buffers: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # largest device allocations
    max_seq_len: int | None = None
    optimizer_on_host: bool = False  # --optim.offload: the optimizer state's shard is in pinned host memory
    memory_flags: str | None = None  # --memory auto: the train flags of the memory tools it chose

    @property
    def fits(self) -> bool:
        return self.memory["total_bytes"] <= self.memory["budget_bytes"]

    @property
    def flops_per_device(self) -> float:
        return self.flops_per_step / self.num_devices

    @property
    def compute_floor_s(self) -> float:
        return self.flops_per_device / self.target.peak_flops

    @property
    def host_link_floor_s(self) -> float:
        """Seconds the host transfers of a step take at the PCIe bandwidth if nothing overlapped."""
        return self.memory.get("host_transfer_bytes", 0) / self.target.host_link_bytes_per_s

    @property
    def comm_floor_s(self) -> float:
        intra = sum(c.intra_host_bytes for c in self.collectives.values())
        inter = sum(c.inter_host_bytes for c in self.collectives.values())
        return intra / self.target.nvlink_bytes_per_s + inter / self.target.network_bytes_per_s

    def to_json(self) -> dict:
        return {
            "device_kind": self.target.device_kind,
            "target": self.target.name,
            "num_devices": self.num_devices,
            "hosts": self.hosts,
            "mesh": self.mesh,
            "model": self.model,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "per_device": self.memory,
            "breakdown": self.breakdown,
            "fits": self.fits,
            "collectives": {k: c.as_dict() for k, c in self.collectives.items()},
            "flops_per_step": self.flops_per_step,
            "flops_per_device": self.flops_per_device,
            "compute_floor_s": self.compute_floor_s,
            "comm_floor_s": self.comm_floor_s,
            "host_link_floor_s": self.host_link_floor_s,
            "optimizer_on_host": self.optimizer_on_host,
            "kernels": [dataclasses.asdict(k) for k in self.kernels],
            "largest_buffers": [{"bytes": n, "shapes": shapes} for n, shapes in self.buffers],
            "compile_seconds": self.compile_seconds,
            "max_seq_len": self.max_seq_len,
            "memory_flags": self.memory_flags,
        }


# ------------------------------------------------------------------------------------ compiling


def _shard_bytes(tree) -> int:
    """Bytes one device holds of the (abstract, sharded) arrays in ``tree`` (the largest device's share)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _mesh(cfg: PlanConfig, model, seq_len: int):
    if not 0 < cfg.budget_fraction <= 1:
        raise ValueError(f"--budget-fraction ({cfg.budget_fraction}) must be in (0, 1], e.g. 0.9")
    target = get_target(cfg.target)
    devices = target_devices(target.name, devices=cfg.devices, hosts=cfg.hosts)
    try:
        mesh = build_mesh(cfg.mesh, model, seq_len, devices=devices)
    except ValueError as e:
        raise ValueError(f"--devices {cfg.devices} does not fit the mesh flags: {e}") from None
    return target, mesh


def _model(cfg: PlanConfig):
    if cfg.init_from_hf is not None and cfg.tokenizer is None:
        return model_config(cfg, 0)  # the folder's config.json alone (a folder of config.json only plans too)
    vocab = make_tokenizer(cfg.tokenizer).vocab_size  # reads a tokenizer file at most, never data
    return model_config(cfg, vocab)


def largest_buffers(dump_dir: str | pathlib.Path, n: int = 12) -> list[tuple[int, str]]:
    """The ``n`` largest device allocations ``(bytes, values sharing it)`` from XLA's memory-usage report."""
    reports = sorted(pathlib.Path(dump_dir).glob("*gpu_after_optimizations-memory-usage-report.txt"))
    if not reports:
        return []
    text = reports[-1].read_text().split("Memory Space:")
    device = next((t for t in text if t.lstrip().startswith("default")), "")
    rows = []
    for m in re.finditer(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*\d+;\s*(.*)$", device, re.M):
        size = float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(m.group(2), 1)
        rows.append((int(size), m.group(3).strip()))
    return sorted(rows, key=lambda r: -r[0])[:n]


def plan(cfg: PlanConfig, *, seq_len: int | None = None, with_kernels: bool | None = None,
         detail: bool = True) -> Plan:
    """Compile ``cfg``'s train step for ``cfg.devices`` compile-only GPUs and report it (module doc).

    ``detail``: dump the compiled program to read its largest buffers (and, with ``with_kernels``, the kernels'
    ptxas figures); the search for the longest context skips it.
    """
    seq_len = cfg.seq_len if seq_len is None else seq_len
    model = _model(cfg)
    target, mesh = _mesh(cfg, model, seq_len)
    batch_size = resolve_batch(cfg.batch_size, mesh, cfg.grad_accum)
    check_parallel(model, mesh, seq_len=seq_len, batch_size=batch_size, grad_accum=cfg.grad_accum)
    check_offload_params(model.offload_params, cfg.optim, cfg.grad_accum)
    if model.offload_params:
        raise ValueError("plan cannot compile --offload-params for compile-only GPUs yet: their devices have no memory "
                         "kinds, so the layers' gradients cannot be typed as host memory; plan without it (train runs "
                         "it on devices with memory kinds: GPUs, and CPUs where it is tested)")
    tx = make_optimizer(cfg.optim, cfg.steps)
    graphdef, state = abstract_state(model, mesh, tx, cfg.seed)
    step = make_train_step(graphdef, tx, make_schedule(cfg.optim, cfg.steps), mesh,
                           jax.tree.map(lambda x: x.sharding, state), grad_accum=cfg.grad_accum)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
             for k in BATCH_KEYS}
    with_kernels = cfg.kernels if with_kernels is None else with_kernels
    t0 = time.perf_counter()
    lowered = step.trace(state, batch).lower()
    with tempfile.TemporaryDirectory(prefix="ulysses-plan-") as dump:
        compiled = lowered.compile(compiler_options=dump_options(dump) if detail else None)
        found = kernels(dump, prefix="flash_attention") if detail and with_kernels else []
        buffers = largest_buffers(dump) if detail else []
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    total = device_total_bytes(mem)
    host = (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes + mem.host_temp_size_in_bytes
            - mem.host_alias_size_in_bytes)
    memory = {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "host_bytes": host,
        "total_bytes": total,
        "budget_bytes": int(cfg.budget_fraction * target.memory_bytes),
        "device_bytes": target.memory_bytes,
    }
    params = _shard_bytes(state["params"])
    memory["host_transfer_bytes"] = host_transfer_bytes(cfg, model, dict(mesh.shape), seq_len, batch_size,
                                                        _shard_bytes(state["opt_state"]),
                                                        _shard_bytes(state["params"]["blocks"]))
    breakdown = {
        "parameters": params,
        "optimizer": _shard_bytes(state["opt_state"]),
        "gradients": params,
        "batch": _shard_bytes(batch),
        "activations": max(mem.temp_size_in_bytes - params, 0),
    }
    per_host = cfg.devices // cfg.hosts
    colls = hlo.collectives(compiled.as_text(), devices_per_host=per_host, num_devices=cfg.devices)
    return Plan(
        target=target, num_devices=cfg.devices, hosts=cfg.hosts, mesh=dict(mesh.shape), model=model.name,
        seq_len=seq_len, batch_size=batch_size, memory=memory, breakdown=breakdown, collectives=colls,
        flops_per_step=flops.training_flops(model, batch=batch_size, seq_len=seq_len), kernels=found,
        compile_seconds=seconds, buffers=buffers, optimizer_on_host=cfg.optim.offload,
    )


def host_transfer_bytes(cfg: PlanConfig, model, mesh: dict[str, int], seq_len: int, batch_size: int,
                        optimizer_bytes: int, layer_param_bytes: int = 0) -> int:
    """Bytes one device moves over PCIe per step (both ways): the optimizer state in and out (``--optim.offload``),
    the saved layer inputs out and back (``--remat offload``: one per ``--remat-every`` layers), and with
    ``--offload-params`` the stacked layers' parameters in for the forward (and again for the recomputation under
    remat), their gradients out, in twice for the update (norm, then update) and the new parameters out."""
    total = 2 * optimizer_bytes if cfg.optim.offload else 0
    if model.offload_params:
        total += (5 + (model.remat != "none")) * layer_param_bytes
    if model.remat == "offload":
        local_tokens = (batch_size // (mesh["data"] * mesh["fsdp"])) * (seq_len // (mesh.get("ring", 1) * mesh["sp"]))
        saved = model.num_layers // model.remat_every
        total += 2 * saved * local_tokens * model.hidden * model.compute_jnp_dtype.itemsize
    return total


def seq_len_unit(cfg: PlanConfig, sp: int) -> int:
    """The step of the search: sequence lengths divisible by sp, each device's part by the chunk sizes and 128."""
    chunk = math.lcm(128, cfg.loss_chunk or 1, cfg.mlp_chunk or 1, cfg.attn_chunk or 1)
    return sp * chunk


def search_units(fits, *, start: int, max_units: int) -> int:
    """The largest ``n`` in ``[0, max_units]`` with ``fits(n)``, for ``fits`` true up to a boundary and false after.

    Starts at ``start``, doubles (or halves) to bracket the boundary, then bisects: about ``2 log2(answer)`` calls.
    """
    lo, hi = 0, max_units + 1  # lo fits (0 trivially), hi does not
    n = min(max(start, 1), max_units)
    if fits(n):
        lo = n
        while lo < max_units:
            n = min(2 * lo, max_units)
            if not fits(n):
                hi = n
                break
            lo = n
    else:
        hi = n
        while hi > 1:
            n = hi // 2
            if fits(n):
                lo = n
                break
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def find_max_seq_len(cfg: PlanConfig, *, log=print) -> Plan:
    """The plan at the longest sequence length that fits (``max_seq_len`` set; 0 when even one unit does not)."""
    _, mesh = _mesh(cfg, _model(cfg), cfg.seq_len)
    # the mesh the search plans on: resolved once, so that an automatic --mesh.sp does not change with the length
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(**{a: mesh.shape[a] for a in ("data", "fsdp", "ring", "sp")}))
    unit = seq_len_unit(cfg, mesh.shape["ring"] * mesh.shape["sp"])  # the sequence splits over ring x sp

    def fits(n_units: int) -> bool:
        p = plan(cfg, seq_len=n_units * unit, detail=False)
        log(f"  seq_len {n_units * unit:>11,}: {gib(p.memory['total_bytes'])} GiB per device "
            f"({'fits' if p.fits else 'over'}; {p.compile_seconds:.0f} s to compile)")
        return p.fits

    best_units = search_units(fits, start=cfg.seq_len // unit, max_units=MAX_SEQ_LEN // unit)
    best = plan(cfg, seq_len=max(best_units, 1) * unit)
    best.max_seq_len = best_units * unit
    return best


# ------------------------------------------------------------------------------------ report


def memory_choices(cfg: PlanConfig, num_layers: int) -> list[tuple[str, dict]]:
    """``(train flags, PlanConfig changes)`` of each set of memory tools ``--memory auto`` tries."""
    k = min((d for d in range(2, num_layers + 1) if num_layers % d == 0), key=lambda d: abs(d - math.sqrt(num_layers)),
            default=1)
    host = dict(param_dtype="bfloat16", optim=dataclasses.replace(cfg.optim, master_weights=True, offload=True))
    host_flags = "--param-dtype bfloat16 --optim.master-weights --optim.offload"
    choices = [("--remat full", dict(remat="full", remat_every=None))]
    if k > 1:
        choices.append((f"--remat full --remat-every {k}", dict(remat="full", remat_every=k)))
    choices.append((f"--remat offload {host_flags}", dict(remat="offload", remat_every=None, **host)))
    if num_layers % 2 == 0:
        choices.append((f"--remat offload --remat-every 2 {host_flags}", dict(remat="offload", remat_every=2, **host)))
    if cfg.mesh.ring == 1:  # the tiled attention sublayer tiles the Ulysses exchange of a mesh without a ring
        c = cfg.attn_chunk or cfg.mlp_chunk or 4096
        tiled = f"--attn-chunk {c} --attn-head-chunk 1"  # one query head per group: the smallest kernel buffers
        choices.append((f"--remat offload {host_flags} {tiled}",
                        dict(remat="offload", remat_every=None, attn_chunk=c, attn_head_chunk=1, **host)))
        if num_layers % 2 == 0:  # two layers' inputs on the device in a group's backward: no attention output there
            choices.append((f"--remat offload --remat-every 2 {host_flags} {tiled} --attn-recompute",
                            dict(remat="offload", remat_every=2, attn_chunk=c, attn_head_chunk=1, attn_recompute=True,
                                 **host)))
    return choices


def _host_budget(cfg: PlanConfig) -> float:
    """``--host-memory-gib`` in bytes, checked."""
    if cfg.host_memory_gib < 0:
        raise ValueError(f"--host-memory-gib ({cfg.host_memory_gib}) must be >= 0")
    return cfg.host_memory_gib * GiB


def auto_memory(cfg: PlanConfig, *, log=print) -> Plan:
    """``--memory auto``: the longest context over ``memory_choices`` whose host memory per GPU fits the budget."""
    budget = _host_budget(cfg)
    best, results = None, []
    for flags, changes in memory_choices(cfg, _model(cfg).num_layers):
        log(f"{flags}:")
        p = find_max_seq_len(dataclasses.replace(cfg, memory="manual", **changes), log=log)
        host_ok = p.memory["host_bytes"] <= budget
        results.append((flags, p.max_seq_len, p.memory["host_bytes"], host_ok))
        if host_ok and p.max_seq_len and (best is None or p.max_seq_len > best.max_seq_len):
            best, best_flags = p, flags
    log("Memory tools tried (longest context, host memory per GPU):")
    for flags, n, host, ok in results:
        log(f"  {n:>12,} tokens  {gib(host):>8} GiB host{'' if ok else ' (over --host-memory-gib)'}  {flags}")
    if best is None:
        raise ValueError("no set of memory tools fits even one unit of the sequence on these devices within "
                         f"--host-memory-gib {cfg.host_memory_gib}; plan more devices")
    best.memory_flags = best_flags
    return best


def auto_fit(cfg: PlanConfig, *, log=print) -> Plan:
    """``--memory auto`` without ``--find-max-seq-len``: the first of ``memory_choices`` (cheapest first) that fits
    ``--seq-len`` with its host memory per GPU within the budget."""
    budget = _host_budget(cfg)
    for flags, changes in memory_choices(cfg, _model(cfg).num_layers):
        trial = dataclasses.replace(cfg, memory="manual", **changes)
        p = plan(trial, detail=False)
        host_ok = p.memory["host_bytes"] <= budget
        log(f"  {gib(p.memory['total_bytes']):>8} GiB per device, {gib(p.memory['host_bytes']):>8} GiB host: "
            f"{'fits' if p.fits and host_ok else 'over'}  {flags}")
        if p.fits and host_ok:
            best = plan(trial)
            best.memory_flags = flags
            return best
    raise ValueError(f"no set of memory tools fits --seq-len {cfg.seq_len} on these devices within --host-memory-gib "
                     f"{cfg.host_memory_gib}; plan more devices, or find the longest that fits with --find-max-seq-len")


def run_plan(cfg: PlanConfig, *, log=print) -> Plan:
    """What ``ulysses-jax plan`` does: plan (or search), print, and write the JSON if asked."""
    if cfg.json is not None and pathlib.Path(cfg.json).is_dir():
        raise ValueError(f"--json {cfg.json} is a directory; give a file path such as plan.json")
    if cfg.find_max_seq_len:
        p = auto_memory(cfg, log=log) if cfg.memory == "auto" else find_max_seq_len(cfg, log=log)
    else:
        p = auto_fit(cfg, log=log) if cfg.memory == "auto" else plan(cfg)
    log(format_plan(p))
    if cfg.json is not None:
        path = pathlib.Path(cfg.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(p.to_json(), indent=1))
    return p
