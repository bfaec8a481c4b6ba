"""The text a plan prints: memory per device and host against both budgets, the largest buffers, collectives,
kernels, the step's floors and its estimated time, and the train flags of the planned program.
"""

from __future__ import annotations

import shlex

from ulysses_jax.plan.estimate import CALIBRATION_SPREAD

GiB = 2**30

def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def format_plan(p) -> str:
    """A ``planner.Plan`` as the lines ``ulysses-jax plan`` prints."""
    m, b = p.memory, p.breakdown
    mesh = " x ".join(f"{k}={v}" for k, v in p.mesh.items())
    lines = [
        f"Plan: {p.model}, {p.batch_size} x {p.seq_len:,} tokens per step, on {p.num_devices} x {p.target.device_kind}"
        f" ({p.hosts} host{'s' if p.hosts > 1 else ''}), mesh {mesh}",
        "",
        "Memory per device (GiB; XLA's buffers, from the compiled GPU program)",
        f"  parameters            {gib(b['parameters']):>9}   (state shard)",
        f"  optimizer state       {gib(b['optimizer']):>9}   "
        f"({'state shard, in pinned host memory: not in the total' if p.optimizer_on_host else 'state shard'})",
        f"  gradients             {gib(b['gradients']):>9}   (estimate: one parameter shard, inside temp)",
        f"  activations and temps {gib(b['activations']):>9}   (temp - gradients)",
        f"  batch                 {gib(b['batch']):>9}",
        f"  argument / output / temp / alias: {gib(m['argument_bytes'])} / {gib(m['output_bytes'])} / "
        f"{gib(m['temp_bytes'])} / {gib(m['alias_bytes'])}",
        f"  total                 {gib(m['total_bytes']):>9}   = argument + output + temp - alias",
        f"  device budget         {gib(m['budget_bytes']):>9}   = {m['budget_bytes'] / m['device_bytes']:.0%} of "
        f"{gib(m['device_bytes'])} (margin for CUDA context, NCCL, fragmentation), in a memory pool of "
        f"{p.memory_fraction:.0%} (train --memory-fraction {p.memory_fraction})",
        f"  host (pinned) memory  {gib(m['host_bytes']):>9}   (per GPU)",
        f"  host budget           {gib(m['host_budget_bytes']):>9}   per GPU: {p.host_budget_note}",
        f"  verdict: {'FITS' if p.fits else 'OVER'} (device {'within' if p.fits_device else 'OVER'} budget, host "
        f"{'within' if p.fits_host else 'OVER'} budget of {gib(m['host_budget_bytes']).strip()} GiB per GPU, "
        f"{'assumed: --host-memory-gib to give the real one' if p.host_budget_assumed else 'from --host-memory-gib'})",
        "",
        "Collectives per step (per device; the layer loop counted once per layer)",
    ]
    for kind, c in sorted(p.collectives.items()):
        lines.append(
            f"  {kind:<20} {c.count:>6} ops {gib(c.bytes):>9} GiB  (NVLink {gib(c.intra_host_bytes)}, "
            f"network {gib(c.inter_host_bytes)}; async {c.async_pairs}, overlapping compute {c.overlapped})"
        )
    lines += [
        "",
        f"Model FLOPs per step: {p.flops_per_step:.3e} ({p.flops_per_device:.3e} per device)",
        f"  compute floor {seconds(p.compute_floor_s)} per step at {p.target.peak_flops / 1e12:.0f} TFLOP/s dense bf16 "
        f"(a bound, not a measurement)",
        f"  collective floor {seconds(p.comm_floor_s)} if nothing overlapped (NVLink "
        f"{p.target.nvlink_bytes_per_s / 1e9:.0f} GB/s, network {p.target.network_bytes_per_s / 1e9:.0f} GB/s per GPU)",
        f"  host link floor {seconds(p.host_link_floor_s)}: {gib(m.get('host_transfer_bytes', 0))} GiB over PCIe per "
        f"step per GPU if nothing overlapped ({p.target.host_link_bytes_per_s / 1e9:.0f} GB/s; optimizer offload, "
        f"remat offload)",
    ]
    if p.estimate is not None:
        e = p.estimate
        lines += [
            f"Estimated step time (an ESTIMATE, not a measurement): {seconds(e['step_seconds'])} "
            f"per step, {e['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU, MFU {e['mfu']:.1%}",
            "  nearest measured row: " + (e.get("nearest_measured") or f"none of {p.model} on a {p.target.name.upper()} "
                                          f"(ulysses_jax/plan/measured.py lists what GPUs have run)"),
            f"  published-run range: {seconds(e['trust_band_seconds'][0])} to {seconds(e['trust_band_seconds'][1])} "
            f"per step, if this run fares as published runs of the same shapes did: they took "
            f"{CALIBRATION_SPREAD[0]}x to {CALIBRATION_SPREAD[1]}x the estimate (other kernels and methods, so the "
            f"estimate lies below the range; experiments/results/plan_calibration_h100.md)",
            "  parts: " + ", ".join(f"{k[:-2]} {seconds(v)}" for k, v in e["parts"].items() if v or k != "matmul_fp8_s"),
            "  assumptions:",
        ]
        lines += [f"    - {a}" for a in e["assumptions"]]
    if p.kernels:
        lines += ["", "Pallas kernels (ptxas -v, sm_90a)"]
        for k in p.kernels:
            lines.append(
                f"  {k.name:<22} grid {k.grid} {k.warps} warps, shared memory {k.shared_memory_bytes:,} B, "
                f"registers {k.registers}, spills {k.spill_store_bytes} B stored / {k.spill_load_bytes} B loaded"
            )
    if p.buffers:
        lines += ["", "Largest device buffers (GiB; XLA's memory-usage report: what fills the device)"]
        lines += [f"  {gib(n):>8}  {shapes[:110]}" for n, shapes in p.buffers[:8]]
    if p.peak is not None and p.peak.values:
        lines += ["", f"Alive where device memory peaks (GiB; XLA's live ranges: {gib(p.peak.live_bytes)} alive at "
                      f"once, in a layout of {gib(p.peak.heap_bytes)}): what to remove to go longer"]
        lines += [f"  {gib(v.bytes):>8}  {v.shape.split('{')[0]:<28} {v.where(80) or '(made by XLA)'}"
                  for v in p.peak.values[:8]]
    if p.max_seq_len is not None:
        lines += ["", f"Longest sequence that fits: {p.max_seq_len:,} tokens"]
    if p.memory_flags is not None:
        lines += [f"Memory tools chosen (--memory auto); train with: {p.memory_flags} --seq-len "
                  f"{p.max_seq_len if p.max_seq_len is not None else p.seq_len}"]
    if p.notes:
        lines += ["", "Compile-only target vs a GPU (what this program cannot hold the same way):"]
        lines += [f"  - {n}" for n in p.notes]
    lines += train_command_lines(p)
    lines.append(f"(compiled in {p.compile_seconds:.1f} s; optimised HLO fingerprint {p.hlo_fingerprint})")
    return "\n".join(lines)


def train_command_lines(p) -> list[str]:
    """The report's last block: the ``train`` command of the planned program, headed by whether it fits, and a word
    when no ``--data`` was given (the command would then train on the built-in corpus)."""
    if not p.train_args:
        return []
    head = ("Train the planned program with:" if p.fits else
            "The planned program does NOT fit (verdict OVER above); its train flags, for reference only:")
    lines = ["", head, f"  ulysses-jax train {shlex.join(p.train_args)}"]
    if "--data" not in p.train_args:
        lines.append("  (no --data given to plan: as written it trains on the built-in corpus, the Python standard "
                     "library's sources; add --data and --tokenizer for your own)")
    return lines
