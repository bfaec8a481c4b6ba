"""``ulysses-jax plan``: will this model, at this context, fit on these GPUs, and what does a step cost?

``plan(PlanConfig(...))`` compiles the *real* training step of ``ulysses-jax train`` (the same ``TrainConfig`` gives
the model, mesh, optimizer, step function with its shardings, donation, gradient accumulation and memory tools)
for compile-only GPUs (``ulysses_jax.plan.targets``) on abstract arrays: nothing is allocated and no data is read.

Memory per device comes from XLA's buffer assignment (``compiled.memory_analysis()``): ``argument`` (train state
and batch), ``output`` (new state, metrics), ``temp`` (activations, gradients, workspaces), ``alias`` (outputs
written into the donated state). ``total = argument + output + temp - alias``. XLA's figure leaves out the CUDA
context (about 0.5 GiB), NCCL's buffers, cuBLAS workspaces and allocator fragmentation, so a plan *fits* when the
total is within ``budget_fraction`` (default 0.9) of the device's memory: 7.9 GiB of margin on an H100. JAX
preallocates 75% of the memory by default; ``train --memory-fraction`` (default 0.95, written into the plan's
``train_args``) makes the pool hold the budget, leaving 5% of the device for the context and NCCL outside the pool.
The verdict is joint: ``fits`` when the device total is within that budget *and* the pinned host memory per GPU is
within ``--host-memory-gib`` (default: 90% of the target's node's host memory over its GPUs, ``targets.py``).

Of the total, ``parameters`` and ``optimizer`` are exact (the state's shards on one device); ``gradients`` is one
parameter shard's worth, an estimate of what the step holds at the end of the backward inside ``temp``;
``activations`` is the rest of ``temp``. Collectives come from the GPU HLO (``ulysses_jax.plan.hlo``: the layer loop
counted once per layer). Model FLOPs and the time they need at the device's dense bf16 peak give a *floor* of the
step time, not a prediction; link bandwidths likewise give a floor for the collectives if nothing overlapped.
``ulysses_jax.plan.estimate`` turns them into an *estimate* of the step time, labelled as one with its assumptions.
Pallas kernels are listed with ptxas's registers and spills (``ulysses_jax.plan.kernel_report``).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import tempfile
import time
from typing import Literal

import jax
import jax.numpy as jnp

from ulysses_jax.data.tokenizers import make_tokenizer
from ulysses_jax.kernels.cudnn_packed import packed_workspace_bytes, resolve_max_documents
from ulysses_jax.model import flops, fp8, lora
from ulysses_jax.parallel.head_layout import plan_heads
from ulysses_jax.plan import hlo, measured, reruns
from ulysses_jax.plan.estimate import attention_kernel, step_estimate
from ulysses_jax.plan.flags import train_args
from ulysses_jax.plan.kernel_report import KernelInfo, dump_options, kernels
from ulysses_jax.plan.peak import Peak, peak
from ulysses_jax.plan.report import GiB
from ulysses_jax.plan.targets import HOST_SHARE, GpuTarget, get_target, target_devices
from ulysses_jax.train.config import TrainConfig, model_config
from ulysses_jax.train.devices import (
    build_mesh,
    check_memory_fraction,
    check_parallel,
    device_total_bytes,
    resolve_batch,
)
from ulysses_jax.train.program import optimizer_of, step_program
from ulysses_jax.train.step import abstract_state, check_offload_params, check_warmup

MAX_SEQ_LEN = 2**28  # the search for the longest context stops here (268M tokens)


@dataclasses.dataclass(frozen=True)
class PlanConfig(TrainConfig):
    """Plan a run: every `train` flag (run, data and process flags are ignored), plus the target GPUs."""

    target: str = "h100"  # compile-only GPU: h100 (SXM 80 GB) or h200 (141 GB)
    devices: int = 8  # GPUs in the planned job
    hosts: int = 1  # hosts they are spread over (devices / hosts GPUs each)
    budget_fraction: float = 0.9  # share of device memory XLA's buffers may use (the rest: CUDA, NCCL, fragmentation)
    find_max_seq_len: bool = False  # search for the longest --seq-len that fits, and plan it
    memory: Literal["manual", "auto"] = "manual"
    """auto: compile the sets of memory tools (remat full, with attention's output kept, with the MLP's products
    too, every k-th layer, offload with the optimizer in host memory, every 2nd layer, the tiled attention in head
    groups) and print the train flags: of those that fit --seq-len the one of the shortest estimated step (of those
    within 2% of it, the fastest needing at most 75% of the device budget and no host memory, or where none does the
    least memory), or with --find-max-seq-len the one with the longest context; host memory within
    --host-memory-gib. (train --memory auto does the same by itself)"""
    memory_unroll: bool = True
    """--memory auto for --seq-len on one GPU: also compile the chosen set with the layer loop unrolled
    (--scan-unroll: no stacked buffers of saved values filled and sliced, more memory) and, where it fits, pick again
    by the same rule; --no-memory-unroll keeps the loop (train: --no-scan-unroll)"""
    host_memory_gib: float | None = None
    """pinned host memory per GPU a plan may use; None: 90% of the target's node over its GPUs (an 8-GPU node with
    2 TB: 209.5 GiB), printed with the plan"""
    json: str | None = None  # also write the plan as JSON to this file
    hlo_out: str | None = None
    """also write the optimised HLO of the compiled step to this file (with --memory auto: the chosen set's)"""
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
    peak: Peak | None = None  # the values alive where device memory peaks (plan/peak.py)
    max_seq_len: int | None = None
    optimizer_on_host: bool = False  # --optim.offload: the optimizer state's shard is in pinned host memory
    memory_flags: str | None = None  # --memory auto: the train flags of the memory tools it chose
    memory_changes: dict = dataclasses.field(default_factory=dict, repr=False)  # ... as TrainConfig fields
    memory_fraction: float = 0.95  # the share of the GPU JAX's pool must take (train --memory-fraction)
    host_budget_note: str = ""  # where the host budget comes from
    host_budget_assumed: bool = True  # the host budget is the target node's share, not --host-memory-gib
    train_args: list[str] = dataclasses.field(default_factory=list)  # `ulysses-jax train` flags of this program
    hlo_fingerprint: str = ""  # of the optimised HLO (hlo.fingerprint), what train compiles from train_args
    notes: list[str] = dataclasses.field(default_factory=list)  # where the compile-only program differs from a GPU's
    estimate: dict | None = None  # estimate.step_estimate: seconds per step, tokens/s per GPU, MFU, assumptions
    alternatives: list[dict] = dataclasses.field(default_factory=list)  # --memory auto: the runners-up
    hlo_text: str = dataclasses.field(default="", repr=False)  # the optimised HLO (--hlo-out writes it)

    @property
    def fits_device(self) -> bool:
        return self.memory["total_bytes"] <= self.memory["budget_bytes"]

    @property
    def fits_host(self) -> bool:
        return self.memory["host_bytes"] <= self.memory["host_budget_bytes"]

    @property
    def fits(self) -> bool:
        """The verdict: within the device budget and the host budget."""
        return self.fits_device and self.fits_host

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
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "budget_bytes": self.memory["budget_bytes"],
            "host_budget_bytes": self.memory["host_budget_bytes"],
            "host_budget": self.host_budget_note,
            "host_budget_assumed": self.host_budget_assumed,
            "memory_fraction": self.memory_fraction,
            "train_args": self.train_args,
            "hlo_fingerprint": self.hlo_fingerprint,
            "notes": self.notes,
            "estimate": self.estimate,
            "alternatives": self.alternatives,
            "collectives": {k: c.as_dict() for k, c in self.collectives.items()},
            "flops_per_step": self.flops_per_step,
            "flops_per_device": self.flops_per_device,
            "compute_floor_s": self.compute_floor_s,
            "comm_floor_s": self.comm_floor_s,
            "host_link_floor_s": self.host_link_floor_s,
            "optimizer_on_host": self.optimizer_on_host,
            "kernels": [dataclasses.asdict(k) for k in self.kernels],
            "largest_buffers": [{"bytes": n, "shapes": shapes} for n, shapes in self.buffers],
            "peak_live": None if self.peak is None else {
                "live_bytes": self.peak.live_bytes, "heap_bytes": self.peak.heap_bytes,
                "values": [dataclasses.asdict(v) for v in self.peak.values]},
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


def budgets(cfg: PlanConfig, target: GpuTarget) -> tuple[float, int, int, str]:
    """``(memory fraction, device budget bytes, host budget bytes per GPU, where the host budget comes from)``."""
    if not 0 < cfg.budget_fraction <= 1:
        raise ValueError(f"--budget-fraction ({cfg.budget_fraction}) must be in (0, 1], e.g. 0.9")
    fraction = check_memory_fraction(cfg.memory_fraction)
    if cfg.budget_fraction > fraction:
        raise ValueError(f"--budget-fraction ({cfg.budget_fraction}) must be at most --memory-fraction ({fraction}): "
                         f"XLA's buffers live in JAX's memory pool; lower --budget-fraction or raise --memory-fraction")
    if cfg.host_memory_gib is None:
        host = target.host_budget_bytes
        note = (f"{HOST_SHARE:.0%} of the host memory of the node assumed, {target.node}, over its "
                f"{target.gpus_per_host} GPUs (--host-memory-gib to change)")
        if cfg.devices < target.gpus_per_host:
            note = (f"ASSUMED: each of these {cfg.devices} GPU(s) gets one GPU's share of a full node, {target.node} "
                    f"({HOST_SHARE:.0%} of its host memory over {target.gpus_per_host} GPUs); a machine with fewer "
                    f"GPUs or less host memory: give its pinned memory per GPU with --host-memory-gib")
    elif cfg.host_memory_gib < 0:
        raise ValueError(f"--host-memory-gib ({cfg.host_memory_gib}) must be >= 0")
    else:
        host, note = int(cfg.host_memory_gib * GiB), "--host-memory-gib"
    return fraction, int(cfg.budget_fraction * target.memory_bytes), host, note


def _mesh(cfg: PlanConfig, model, seq_len: int):
    target = get_target(cfg.target)
    budgets(cfg, target)
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
    if cfg.steps < 1:  # (the schedule would name --optim.decay-steps, which the user did not give)
        raise ValueError(f"--steps ({cfg.steps}) must be at least 1")
    model = _model(cfg)
    target, mesh = _mesh(cfg, model, seq_len)
    batch_size = resolve_batch(cfg.batch_size, mesh, cfg.grad_accum)
    check_parallel(model, mesh, seq_len=seq_len, batch_size=batch_size, grad_accum=cfg.grad_accum)
    check_offload_params(model.offload_params, cfg.optim, cfg.grad_accum)
    if model.offload_params:
        raise ValueError("plan cannot compile --offload-params for compile-only GPUs yet: their devices have no memory "
                         "kinds, so the layers' gradients cannot be typed as host memory; plan without it (train runs "
                         "it on devices with memory kinds: GPUs, and CPUs where it is tested)")
    optim = cfg.optim.resolved(cfg.steps, fine_tuning=cfg.init_from_hf is not None,  # as train resolves it, fresh
                               lora=model.lora is not None)
    check_warmup(cfg.optim, optim.decay_steps)  # a warmup train refuses: not a program to plan
    tx = optimizer_of(optim, cfg.steps)
    graphdef, state = abstract_state(model, mesh, tx, cfg.seed)
    step, batch = step_program(graphdef, state, tx, optim, steps=cfg.steps, mesh=mesh, batch_size=batch_size,
                               seq_len=seq_len, grad_accum=cfg.grad_accum)
    with_kernels = cfg.kernels if with_kernels is None else with_kernels
    t0 = time.perf_counter()
    lowered = step.trace(state, batch).lower()
    with tempfile.TemporaryDirectory(prefix="ulysses-plan-") as dump:
        compiled = lowered.compile(compiler_options=dump_options(dump) if detail else None)
        pallas = ("flash_attention", "grouped_matmul", "gated_delta_scan")
        found = kernels(dump, prefix=pallas) if detail and with_kernels else []
        buffers = largest_buffers(dump) if detail else []
        at_peak = peak(dump) if detail else None
    seconds = time.perf_counter() - t0
    fraction, budget, host_budget, host_note = budgets(cfg, target)
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
        "budget_bytes": budget,
        "device_bytes": target.memory_bytes,
        "host_budget_bytes": host_budget,
    }
    kernel = attention_kernel(model, mesh)
    workspace = cudnn_workspace_bytes(model, dict(mesh.shape), seq_len, batch_size, cfg.grad_accum, kernel)
    memory["cudnn_workspace_bytes"] = workspace
    memory["total_bytes"] += workspace
    params = _shard_bytes(state["params"])
    trained = _shard_bytes(lora.split(fp8.split(state["params"])[0])[0])  # with LoRA: the adapters' alone
    memory["host_transfer_bytes"] = host_transfer_bytes(cfg, model, dict(mesh.shape), seq_len, batch_size,
                                                        _shard_bytes(state["opt_state"]),
                                                        _shard_bytes(state["params"]["blocks"]))
    breakdown = {
        "parameters": params,
        "optimizer": _shard_bytes(state["opt_state"]),
        "gradients": trained,
        "batch": _shard_bytes(batch),
        "activations": max(mem.temp_size_in_bytes - trained, 0),
    }
    per_host = cfg.devices // cfg.hosts
    text = compiled.as_text()
    colls = hlo.collectives(text, devices_per_host=per_host, num_devices=cfg.devices,
                            branch_shares=reruns.branch_shares(model))
    p = Plan(
        target=target, num_devices=cfg.devices, hosts=cfg.hosts, mesh=dict(mesh.shape), model=model.name,
        seq_len=seq_len, batch_size=batch_size, memory=memory, breakdown=breakdown, collectives=colls,
        flops_per_step=flops.training_flops(model, batch=batch_size, seq_len=seq_len), kernels=found,
        compile_seconds=seconds, buffers=buffers, peak=at_peak, optimizer_on_host=cfg.optim.offload,
        memory_fraction=fraction,
        host_budget_note=host_note, host_budget_assumed=cfg.host_memory_gib is None,
        hlo_fingerprint=hlo.fingerprint(text), hlo_text=text,
        train_args=train_args(cfg, seq_len=seq_len, batch_size=batch_size, mesh=dict(mesh.shape),
                              memory_fraction=fraction),
        notes=compile_only_notes(cfg, model, workspace, seq_len) + ([hlo.float8_note(text)] if model.fp8 else [])
        + [n for n in [hlo.parameter_copies_note(text)] if n],
    )
    p.estimate = step_estimate(p, model, kernel)
    near = measured.nearest(target.name, model.name, seq_len, lora=model.lora is not None,
                            flags=" ".join(p.train_args))
    p.estimate["nearest_measured"] = None if near is None else near.describe() + (
        "" if cfg.devices == 1 else f"; one GPU, where this plan has {cfg.devices}")
    return p


def cudnn_workspace_bytes(model, mesh: dict[str, int], seq_len: int, batch_size: int, grad_accum: int,
                          kernel: str) -> int:
    """Per device, the workspace of cuDNN's packed attention (training rows are packed) that XLA's buffer assignment
    for a compile-only GPU leaves out (``kernels/cudnn_packed.py``): one attention call's, over the rows of a
    micro-batch on the device and the heads of one call (a head group with ``attn_head_chunk``); 0 for other
    kernels."""
    if kernel != "cudnn":
        return 0
    rows = max(batch_size // (mesh.get("data", 1) * mesh.get("fsdp", 1) * max(grad_accum, 1)), 1)
    heads = plan_heads(model.num_heads, model.num_kv_heads, mesh.get("sp", 1)).heads_per_device
    if model.attn_chunk and model.attn_head_chunk:
        heads = min(heads, model.attn_head_chunk)
    m = resolve_max_documents(model.attn_max_documents, seq_len)
    return packed_workspace_bytes(rows, seq_len, heads, model.head_dim, m)


def compile_only_notes(cfg: PlanConfig, model, workspace: int = 0, seq_len: int | None = None) -> list[str]:
    """Where the program compiled here differs from the one a GPU runs (the compile-only target lacks it)."""
    notes = []
    if workspace:
        m = resolve_max_documents(model.attn_max_documents, seq_len or cfg.seq_len)
        notes.append(f"cuDNN's packed attention: its workspace ({workspace / GiB:.2f} GiB per device at "
                     f"--attn-max-documents {m}) reads 0 "
                     f"in a compile-only buffer assignment; added to the total from the rule fitted on an H100 "
                     f"(ulysses_jax/kernels/cudnn_packed.py); --attn-max-documents 1 needs none")
    if cfg.optim.offload:
        notes.append("--optim.offload: on a GPU the optimizer state's shardings carry the pinned_host memory kind; the "
                     "compile-only GPUs list no memory kinds, so JAX drops it here and XLA places that state in host "
                     "memory from the program's host-offload annotations alone: the same buffers (host bytes above), "
                     "but the GPU program's parameters are typed as host memory and its HLO text differs there")
    if model.remat == "offload":
        notes.append("--remat offload: the saved layer inputs move to host memory through XLA's host-offload "
                     "annotations, on a GPU as here")
    return notes


def host_transfer_bytes(cfg: PlanConfig, model, mesh: dict[str, int], seq_len: int, batch_size: int,
                        optimizer_bytes: int, layer_param_bytes: int = 0) -> int:
    """Bytes one device moves over PCIe per step (both ways): the optimizer state in and out (``--optim.offload``),
    the saved layer inputs out and back (``--remat offload``: one per ``--remat-every`` layers, and with
    ``--remat-nested`` every layer's again in its group's backward; with ``--attn-keep`` each attention layer's kept
    output and float32 log-sum-exp too, by their shapes; a hybrid keeps nothing there: ``ModelConfig`` refuses
    ``--attn-keep`` with ``--remat offload`` on mixed layer kinds), and with
    ``--offload-params`` the stacked layers' parameters in for the forward (and again for the recomputation under
    remat), their gradients out, in twice for the update (norm, then update) and the new parameters out."""
    total = 2 * optimizer_bytes if cfg.optim.offload else 0
    if model.offload_params:
        total += (5 + (model.remat != "none")) * layer_param_bytes
    if model.remat == "offload":
        local_tokens = (batch_size // (mesh["data"] * mesh["fsdp"])) * (seq_len // (mesh.get("ring", 1) * mesh["sp"]))
        saved = model.num_layers // model.remat_every
        if model.remat_nested and model.remat_every > 1:  # a group's backward offloads its layers' inputs too
            saved += model.num_layers
        total += 2 * saved * local_tokens * model.hidden * model.compute_jnp_dtype.itemsize
        if model.attn_keep:  # the policy offloads the kept attention output and log-sum-exp with the layer inputs
            per_token = model.num_heads * (model.head_dim * model.compute_jnp_dtype.itemsize + 4)
            total += 2 * len(model.attention_layers) * local_tokens * per_token
    return total
