"""An *estimate* of a planned step's time on GPUs, labelled as one with its assumptions and its calibration on the
steps this project has timed (``CALIBRATED_ON``; ``plan`` prints the nearest measured row beside it: ``measured.py``).

Per step and per device, from the compiled plan:

* attention kernels: their FLOPs (forward, the backward's 2.5x in FlashAttention's count, and the forwards run again
  by rematerialisation or ``--attn-recompute``, counted in the compiled program: ``reruns.py``) at a rate per kernel
  and head_dim from ``ATTENTION_RATES``, the one
  table of kernel rates (each row names its source); our Pallas kernel's rate is its static estimate
  (``kernels/flash_estimate.py``) calibrated on the measured Triton tutorial kernel;
* the other matmuls (projections, MLP, unembedding; every dot of the compiled program, re-runs included) at
  ``MATMUL_EFFICIENCY`` of ``MATMUL_RATE`` (the share measured steps reached); with ``--fp8`` all but the
  unembedding's at ``FP8_MATMUL_RATE`` (fitted on measured rows);
* the gated delta rule of a hybrid's linear layers (Qwen3.5, Qwen3-Next): its FLOPs (``model.flops.delta_rule_flops``,
  the chunked kernel's forward and backward, a forward again per re-run of the layers) at ``DELTA_RATE``, measured
  once on an H100 at 32K (the rule runs as plain XLA ops on GPUs: batched 64-token chunk matmuls and a scan over
  chunks). A hybrid's re-runs follow the flags' rule: its layer's switch holds both mixers, so
  the compiled program's counts cannot tell which one ran;
* every other kernel (norms, RoPE, SwiGLU, residual adds, the loss's softmax, float8 amaxes and casts, copies,
  fills, slice updates, the optimizer update) by the bytes it reads and writes in the compiled program
  (``traffic.kernel_bytes``) at ``KERNEL_BANDWIDTH_SHARE`` of the HBM bandwidth (fitted: launch gaps included);
* collectives: bytes over NVLink and the network at ``LINK_EFFICIENCY`` of the nominal bandwidths; those the compiled
  schedule runs asynchronously beside compute (``hlo.Collective.overlapped_bytes``) are hidden up to the compute
  time, the rest is exposed;
* host transfers over PCIe at ``LINK_EFFICIENCY`` of its nominal bandwidth: the saved layer inputs of ``--remat
  offload`` hide behind compute like the overlapped collectives; the streamed optimizer state of ``--optim.offload``
  is exposed (the update has no matmul to hide behind).

``step_seconds = compute + exposed collectives + exposed host transfers``; tokens/s per GPU and the MFU follow. The
MFU counts model FLOPs only (``model.flops``: no recomputation), at the target's dense bf16 peak.
"""

from __future__ import annotations

import dataclasses

from ulysses_jax.kernels import flash_estimate
from ulysses_jax.kernels.attention import device_platform, resolve_impl
from ulysses_jax.model import flops
from ulysses_jax.model.delta_net import group_heads
from ulysses_jax.model.layer_kinds import layer_windows
from ulysses_jax.parallel.head_layout import plan_heads
from ulysses_jax.plan import reruns, traffic


@dataclasses.dataclass(frozen=True)
class KernelRate:
    forward: float  # FLOP/s, causal, counting the unmasked half of the scores
    backward: float  # FLOP/s, FlashAttention's count (2.5x the forward's FLOPs)
    source: str


# H100 SXM, bf16, causal. Sources: our H100 measurement (experiments/results/gpu_h100_20261126: cuDNN 9.19 through
# jax 0.11.2, S 32K, head_dim 128, causal: 609 / 527 TFLOP/s forward / backward; the packed layout on one document
# 3.5% / 6.5% slower: 588 / 493), the FlashAttention-3 paper's cuDNN figures at 16K (539 / 516, an older cuDNN) for
# comparison, and the PTX of our kernels read on compile-only H100s (aot-gpu notes).
ATTENTION_RATES: dict[tuple[str, int], KernelRate] = {
    ("cudnn", 128): KernelRate(588e12, 493e12, "cuDNN packed fused attention, measured on an H100 (cuDNN 9.19, hd128, "
                                               "S 32K, causal): fwd 588 / bwd 493 TFLOP/s; unpacked 609 / 527"),
    ("xla", 128): KernelRate(150e12, 150e12, "assumed, no published figure: XLA's unfused attention writes the "
                                             "scores to memory"),
    ("blockwise", 128): KernelRate(150e12, 150e12, "assumed, no published figure: the blockwise kernel is XLA ops"),
}
# the share of the hd128 rate at other head dims: hd64 fitted on the measured one-GPU steps (CALIBRATED_ON below: the
# llama3.2-1b rows, cuDNN 9.19; 0.74 on the H100's rows of 2026-11-27, whose 1B steps ran cuDNN's packed layout);
# hd256 assumed (FlashAttention-2/3 run below their hd128 rate there)
HEAD_DIM_FACTOR = {64: (0.88, "fitted on measured steps"), 256: (0.9, "assumed")}
# The trust band: published runs of the same model, context and GPU count took this many times the estimate's step
# time (experiments/results/plan_calibration_h100.md, rerun 2026-11-28 night with the estimate calibrated on our own
# measured steps, the other kernels timed by their bytes: TRL, torchtitan, the HF blog; their methods differ from
# ours, which is why the band is wide).
CALIBRATION_SPREAD = (1.13, 2.63)
MATMUL_RATE = 790e12  # bf16 GEMM on H100: 798 TFLOP/s measured at 8192^3 (aot-gpu notes), 790-800 in the anchors
# The calibration on this project's own measured steps: one H200, batch 1, one document a row, bf16 and float8, the
# program of commit 274568a (experiments/results/peers_h200_20261128b.csv, 9 rows: llama3.2-1b full at 32K,
# llama3.1-8b LoRA r16 at 8K and 32K). Fitted there (experiments/plan_vs_measured.py --fit, least squares on the
# relative error): the matmuls ran at MATMUL_EFFICIENCY of MATMUL_RATE, float8 GEMMs at FP8_MATMUL_RATE of the same
# kind, head_dim 64 attention at HEAD_DIM_FACTOR[64] of the hd128 rate, and the other kernels moved their bytes at
# KERNEL_BANDWIDTH_SHARE of the HBM bandwidth. In-sample every row within 3.0%, each row left out of the fit within
# 5.2% (experiments/results/plan_vs_measured_h200_20261128c.md; the same after the gather fix, _20261129.md).
# Before the other kernels were timed by the compiled
# program's bytes (16 passes a layer: a fifth of what those programs move), the fit put the rest into the matmuls
# (0.68, hd64 0.85, float8 1110e12): rows within 6.2%, left out within 8.8%, and a program's copies and fills (what
# --scan-unroll removes) were not seen (plan_vs_measured_h200_20261128b.md). The first fit, on the H100's 8 rows of
# 2026-11-27 (an older program), gave 0.64 and hd64 0.74 (experiments/results/plan_vs_measured_h100.md).
CALIBRATED_ON = "experiments/results/peers_h200_20261128b.csv"
MATMUL_EFFICIENCY = 0.90
# float8 GEMM (--fp8; ours: per-tensor rescaled operands): the dense FP8 peak is 1979 TFLOP/s and large FP8 GEMMs
# alone are reported at 1300-1500. Fitted at 865e12 on the H100's two float8 rows of 2026-11-27 (XLA's Triton float8
# GEMMs); refitted on the H200's of 2026-11-28 (experiments/results/peers_h200_20261128.csv: cuBLASLt's float8 GEMMs,
# which the same image's jax 0.11.2 picked there), where 865e12 put the step 16-22% over the measured one:
# experiments/plan_vs_measured.py --fit gave the float8 matmuls x0.792 (plan_vs_measured_h200_before_refit.md): 1090e12;
# with the calibration above (three float8 rows among the nine) 1110e12, then 1640e12 once the other kernels were
# timed by their bytes (the float8 amaxes and casts among them), 1690e12 once those bytes were counted right: 1521
# TFLOP/s at MATMUL_EFFICIENCY
FP8_MATMUL_RATE = 1690e12
FP8_PASSES = 32
# the experts' Pallas grouped matmul (kernels/grouped_matmul.py) on one H100, forward + backward, Qwen3-30B-A3B's
# shapes, 65,536 rows (8,192 tokens x top-8; 429 TFLOP/s at 262,144 rows): experiments/results/gpu_h100_20261126b
GROUPED_RATE = 333e12
# the delta rule's chunked kernel (kernels/gated_delta.py) as XLA ops, measured on one H100: forward + backward at 32K
# tokens, 16 key / 32 value heads of 128, bf16, 101.0 ms for 6.8e11 matmul FLOPs of gated_delta_flops (elementwise
# work not counted: an effective rate), experiments/results/gpu_h100_20261127/call2/delta.log; it was assumed 50e12.
# Small batched matmuls ([64, 128] tiles) and a sequential scan over chunks; fewer heads per device (sp) untimed
DELTA_RATE = 6.7e12
LINK_EFFICIENCY = 0.8  # assumed: share of the nominal NVLink / network / PCIe bandwidth a transfer achieves
# The kernels that are neither matmuls, attention nor collectives (norms, RoPE, SwiGLU, residual adds, the loss's
# softmax, float8 amaxes and casts, copies, fills, slice updates, the optimizer update) are timed by the bytes the
# compiled program's kernels read and write (traffic.kernel_bytes) at KERNEL_BANDWIDTH_SHARE of the HBM bandwidth: fitted
# on the measured steps (CALIBRATED_ON), it takes in their launch gaps and kernels below the bandwidth. Where the
# program cannot tell them apart (a hybrid's delta rule, attention written as XLA ops), ELEMENTWISE_PASSES over
# [tokens, hidden] per layer forward (FP8_PASSES more for float8) and the optimizer update apart: what the nine
# measured rows' programs moved besides their update, 43-68 passes and 26-46 more for float8. 0.51 until 2026-11-29:
# a gather (the tiled loss's label logit) had been counted as reading its whole operand, 16 GiB a step at llama3.2-1b
# 32K; refitted on the same rows with it counted as the elements it takes (plan_vs_measured_h200_20261129.md)
KERNEL_BANDWIDTH_SHARE = 0.505
ELEMENTWISE_PASSES = 56
OPTIMIZER_BYTES_PER_PARAM = 28  # AdamW in float32: read parameter, gradient, 2 moments; write parameter, 2 moments


def attention_kernel(model, mesh) -> str:
    """The attention kernel the planned step runs (``auto`` resolved for the mesh's devices)."""
    if mesh.shape.get("ring", 1) > 1:
        return "pallas" if model.attention_impl == "auto" else model.attention_impl
    return resolve_impl(model.attention_impl, dtype=model.compute_jnp_dtype, head_dim=model.head_dim,
                        has_segment_ids=True, platform=device_platform(mesh), sinks=model.attn_sinks)


# Our Pallas kernel, measured once (one H100, 2026-11-26, hd128, 32K causal: 398 / 338 TFLOP/s one document, 348 / 319
# with 8 packed documents), takes its rate at any shape from the static estimate of its compiled tiles
# (``kernels/flash_estimate.py``: wgmma on every matmul, causal tiles skipped, softmax not overlapped), scaled by how
# far the measured Triton fused-attention tutorial kernel (378 TFLOP/s causal forward, H100 bf16 hd128 seq 16K: the
# anchors' kernel table) falls below the same estimate of the forward it shares with ours.
TRITON_MEASURED_FORWARD = 378e12


def _pallas_rate(head_dim: int, seq_len: int, peak: float) -> tuple[KernelRate, str]:
    tutorial = flash_estimate.attention_fractions(128, causal=True, seq_len=16_384)["forward"]["no_overlap"]
    scale = TRITON_MEASURED_FORWARD / (tutorial * peak)
    ours = flash_estimate.attention_fractions(head_dim, causal=True, segment_ids=True, seq_len=max(seq_len, 16))
    fwd, bwd = (ours[k]["no_overlap"] * scale * peak for k in ("forward", "backward"))
    fractions = f"{ours['forward']['no_overlap']:.2f} / {ours['backward']['no_overlap']:.2f}"
    source = (f"our Pallas kernel: the static estimate of its tiles at head_dim {head_dim}, {seq_len} "
              f"tokens per call, packed rows (kernels/flash_estimate.py, no softmax overlap: {fractions} of peak) x "
              f"{scale:.2f}, the measured Triton tutorial forward (378 TFLOP/s) over the same estimate of it; measured "
              f"on an H100 at hd128, 32K, 8 packed documents: 348 / 319 TFLOP/s)")
    return KernelRate(fwd, bwd, source), ""


def attention_rate(kernel: str, head_dim: int, seq_len: int = 16_384, peak: float = 989e12
                   ) -> tuple[KernelRate, str]:
    """The rate of ``kernel`` at ``head_dim`` for calls of ``seq_len`` tokens: ``ATTENTION_RATES``' row (scaled from
    hd128 where no row exists), or for ``pallas`` the static estimate calibrated as above."""
    if kernel == "pallas":
        return _pallas_rate(head_dim, seq_len, peak)
    if (kernel, head_dim) in ATTENTION_RATES:
        return ATTENTION_RATES[kernel, head_dim], ""
    base = ATTENTION_RATES.get((kernel, 128), ATTENTION_RATES["xla", 128])
    f, how = HEAD_DIM_FACTOR.get(head_dim, (0.85, "assumed"))
    return KernelRate(base.forward * f, base.backward * f, base.source), f"head_dim {head_dim}: x{f} of hd128 ({how})"


def _recomputed_forwards(model) -> tuple[float, int]:
    """Forwards run again in the backward by the flags' rule, ``(of the layers' matmuls, of attention)``: what the
    estimate falls back on when the compiled program's counts (``reruns.py``) cannot tell (no HLO, attention as XLA
    ops, a ring). It undercounts nested checkpoints: ``--remat-every k > 1`` re-runs a group's forward and then each
    layer's inside it, which the program counts."""
    layers = 1 if model.remat in ("full", "offload") else 0
    matmuls = layers  # the MLP's gate and up kept: its GEMMs are not run again (down's output is not needed there)
    if getattr(model, "mlp_keep", False):
        matmuls -= flops.mlp_matmul_params(model) / flops.layer_matmul_params(model)
    if getattr(model, "attn_keep", False):  # attention's output kept: its forward is not run again
        return matmuls, 0
    return matmuls, layers + (1 if model.attn_chunk and model.attn_recompute else 0)


def _passes(model) -> int:
    """Matmul passes of a step without re-runs, in forwards: forward, the input's gradient and the weight's (3); with
    LoRA 2, the frozen weights having no gradient (the adapters' few FLOPs aside: ``flops.training_flops``)."""
    return 2 if getattr(model, "lora", None) is not None else 3


def counted_reruns(p, model, kernel: str, layer_mm: float, head_mm: float) -> tuple | None:
    """``(matmul FLOPs of the whole step, matmul re-runs of the layers, attention re-runs, note, the FLOPs of those
    in the experts' grouped matmul kernels)`` counted from the compiled program (``p.hlo_text``), or None where the
    program cannot tell them apart (module ``reruns``)."""
    text = getattr(p, "hlo_text", "")
    if not text or kernel not in ("cudnn", "pallas") or getattr(p, "mesh", {}).get("ring", 1) > 1:
        return None
    if model.linear_layers:  # the layer's switch holds both mixers: the program's counts cannot tell which one ran
        return None
    work = reruns.program_work(text, reruns.branch_shares(model))
    mesh = p.mesh
    rows = p.batch_size / (mesh.get("data", 1) * mesh.get("fsdp", 1))
    heads = plan_heads(model.num_heads, model.num_kv_heads, mesh.get("sp", 1)).heads_per_device
    redo_attn = reruns.attention_reruns(work, layers=model.num_layers, batch=rows, heads=heads, seq_len=p.seq_len,
                                        head_dim=model.head_dim)
    if redo_attn is None or not layer_mm:
        return None
    total = work.dot_flops + work.grouped_flops
    redo_mm = max((total - _passes(model) * (layer_mm + head_mm)) / layer_mm, 0.0)
    note = (f"re-runs counted from the compiled program: attention forward {1 + redo_attn:.2f}x per layer "
            f"({work.attention_forward_calls} kernel runs), matmuls {total / (layer_mm + head_mm):.2f}x the "
            f"model's forward ({redo_mm:.2f} forwards of the layers again)")
    if work.grouped_flops:
        note += (f"; the experts' grouped matmul kernels {work.grouped_flops / total:.0%} of the matmul FLOPs, at "
                 f"{GROUPED_RATE / 1e12:.0f} TFLOP/s (our Pallas kernel measured on one H100 at Qwen3-30B-A3B's "
                 f"shapes, 65,536 rows)")
    return total, redo_mm, redo_attn, note, work.grouped_flops


def counted_kernel_bytes(p, model, kernel: str) -> float | None:
    """Bytes per step per device that the compiled program's kernels other than matmuls, attention, collectives and
    host transfers read and write (``traffic.kernel_bytes``), or None where they cannot be told apart: no program, or an
    attention or delta rule written as XLA ops (whose elementwise work is in their own rates)."""
    text = getattr(p, "hlo_text", "")
    if not text or kernel not in ("cudnn", "pallas") or model.linear_layers:
        return None
    return traffic.kernel_bytes(text, reruns.branch_shares(model))


def step_estimate(p, model, kernel: str) -> dict:
    """``{step_seconds, tokens_per_second_per_gpu, mfu, parts, assumptions}`` of plan ``p`` (module doc)."""
    t = p.target
    n, tokens = p.num_devices, p.batch_size * p.seq_len
    # causal pairs per layer; a local layer counts its window's (model.flops.attention_pairs)
    pairs = sum(flops.attention_pairs(p.seq_len, w) for w in layer_windows(model))
    attn_fwd = 4 * p.batch_size * pairs * model.num_heads * model.head_dim / n
    layer_mm = 2 * model.num_layers * flops.layer_matmul_params(model) * tokens / n
    head_mm = 2 * model.vocab_size * model.hidden * tokens / n
    counted = counted_reruns(p, model, kernel, layer_mm, head_mm)
    if counted is None:
        redo_mm, redo_attn = _recomputed_forwards(model)
        matmul_flops = _passes(model) * (layer_mm + head_mm) + redo_mm * layer_mm
        rerun_note = f"{redo_mm:g} recomputed forward of the layers, {redo_attn} of attention (by the flags' rule)"
        grouped = 0.0
    else:
        matmul_flops, redo_mm, redo_attn, rerun_note, grouped = counted
    ring = getattr(p, "mesh", {}).get("ring", 1)  # each kernel call sees S / ring tokens
    rate, rate_note = attention_rate(kernel, model.head_dim, p.seq_len // ring, t.peak_flops)
    attention_s = attn_fwd * (1 + redo_attn) / rate.forward + 2.5 * attn_fwd / rate.backward
    # --fp8: every matmul but the unembedding's (and the experts': refused with --fp8) in float8
    fp8_flops = max(matmul_flops - grouped - _passes(model) * head_mm, 0.0) if getattr(model, "fp8", False) else 0.0
    fp8_s = fp8_flops / (FP8_MATMUL_RATE * MATMUL_EFFICIENCY)
    matmul_s = (matmul_flops - grouped - fp8_flops) / (MATMUL_RATE * MATMUL_EFFICIENCY) + fp8_s + grouped / GROUPED_RATE
    sp = getattr(p, "mesh", {}).get("sp", 1)
    # --delta-head-chunk: each group's body is rematerialised, one more forward of the rule (a key head shared by
    # groups also projects and exchanges again per group: not counted)
    grouped_delta = bool(model.linear_layers and model.delta_head_chunk and len(group_heads(model, sp)[0]) > 1)
    delta_fwd = flops.delta_rule_flops(model, p.seq_len, p.batch_size, backward=False)
    # the layers' forward run again but for the matmuls --mlp-keep keeps (it needs remat full, every layer: once)
    redo_layers = 1.0 if getattr(model, "mlp_keep", False) else redo_mm
    # --attn-keep keeps the delta-net's output and rule states too: remat does not run the rule's forward again
    redo_delta = 0 if getattr(model, "attn_keep", False) else redo_layers
    delta = (flops.delta_rule_flops(model, p.seq_len, p.batch_size) + (redo_delta + grouped_delta) * delta_fwd) / n
    delta_s = delta / DELTA_RATE
    kernels_bw = t.hbm_bytes_per_s * KERNEL_BANDWIDTH_SHARE
    moved = counted_kernel_bytes(p, model, kernel)
    if moved is not None:  # the optimizer update's kernels among them
        elementwise_s, update_s = moved / kernels_bw, 0.0
        moved_note = (f"the kernels other than matmuls, attention and collectives (elementwise work, reductions, "
                      f"copies, fills, slice updates, the optimizer update) read and write {moved / 2**30:,.1f} GiB a "
                      f"step, counted in the compiled program")
    else:
        act_bytes = tokens / n * model.hidden * model.compute_jnp_dtype.itemsize
        passes = ELEMENTWISE_PASSES * (3 + redo_layers) + (FP8_PASSES if fp8_flops else 0)
        elementwise_s = passes * act_bytes * model.num_layers / kernels_bw
        # AdamW updates what trains: LoRA's adapters alone (the frozen base has no optimizer state)
        params = (flops.adapter_matmul_params(model) if model.lora is not None else flops.param_count(model)) / n
        update_s = 0.0 if p.optimizer_on_host else OPTIMIZER_BYTES_PER_PARAM * params / kernels_bw
        moved_note = (f"elementwise work: {ELEMENTWISE_PASSES} passes over [tokens, hidden] per layer forward"
                      f"{f' and {FP8_PASSES} more for float8' if fp8_flops else ''} (what the compiled programs of "
                      f"the measured steps moved; this one's cannot be told from its attention or delta rule); "
                      f"optimizer update " + ("streamed from host memory (its PCIe traffic below)"
                                              if p.optimizer_on_host else
                                              f"{OPTIMIZER_BYTES_PER_PARAM} B per parameter of HBM traffic"))
    compute_s = attention_s + matmul_s + delta_s + elementwise_s + update_s

    hidden_comm = exposed_comm = 0.0
    for c in p.collectives.values():
        seconds = (c.intra_host_bytes / t.nvlink_bytes_per_s + c.inter_host_bytes / t.network_bytes_per_s)
        seconds /= LINK_EFFICIENCY
        share = c.overlapped_bytes / c.bytes if c.bytes else 0.0
        hidden_comm += seconds * share
        exposed_comm += seconds * (1 - share)
    pcie = t.host_link_bytes_per_s * LINK_EFFICIENCY
    optimizer_host = 2 * p.breakdown["optimizer"] if p.optimizer_on_host else 0
    optimizer_host_s = optimizer_host / pcie
    activations_host_s = max(p.memory.get("host_transfer_bytes", 0) - optimizer_host, 0) / pcie
    overlappable = hidden_comm + activations_host_s
    exposed = exposed_comm + max(overlappable - compute_s, 0.0) + optimizer_host_s
    step = compute_s + exposed
    assumptions = [
        f"attention: {kernel} at {rate.forward / 1e12:.0f} TFLOP/s forward, {rate.backward / 1e12:.0f} backward "
        f"({rate.source}{'; ' + rate_note if rate_note else ''}); causal, packed rows counted as one sequence",
        f"other matmuls at {MATMUL_RATE * MATMUL_EFFICIENCY / 1e12:.0f} TFLOP/s: {MATMUL_EFFICIENCY:.0%} of the bf16 "
        f"GEMM measured at 8192^3 ({MATMUL_RATE / 1e12:.0f}), the share the measured steps reached with the work "
        f"around their GEMMs (fitted on {CALIBRATED_ON}); {rerun_note}",
        *([f"--fp8: {fp8_flops / matmul_flops:.0%} of the matmul FLOPs (all but the unembedding) in float8 at "
           f"{FP8_MATMUL_RATE * MATMUL_EFFICIENCY / 1e12:.0f} TFLOP/s (fitted on measured rows; the FP8 peak is "
           f"1979); their amaxes and casts among the kernels below"] if fp8_flops else []),
        f"{moved_note}, at {kernels_bw / 1e12:.2f} TB/s: {KERNEL_BANDWIDTH_SHARE:.0%} of the HBM bandwidth "
        f"({t.hbm_bytes_per_s / 1e12:.2f} TB/s), the share the measured steps' kernels reached with their launch gaps "
        f"(fitted on {CALIBRATED_ON})",
        f"links at {LINK_EFFICIENCY:.0%} of nominal: NVLink {t.nvlink_bytes_per_s / 1e9:.0f}, network "
        f"{t.network_bytes_per_s / 1e9:.0f}, PCIe {t.host_link_bytes_per_s / 1e9:.0f} GB/s per GPU; collectives the "
        f"compiled schedule overlaps, and remat-offload transfers, hidden up to the compute time; optimizer-offload "
        f"transfers exposed",
        "not counted: data loading, the first step's compile, stragglers",
    ]
    if model.linear_layers:
        bf16 = model.delta_precision == "bf16"
        pallas = model.delta_impl == "pallas"
        untimed = [x for x, on in (("--delta-precision bf16", bf16), ("--delta-impl pallas", pallas)) if on]
        assumptions.insert(2, f"the gated delta rule of the {len(model.linear_layers)} linear layers: "
                              f"{delta * n / 1e12:,.1f} TFLOP per step (its chunked kernel's forward and backward) at "
                              f"{DELTA_RATE / 1e12:.1f} TFLOP/s, the rate measured for our plain-XLA kernel on one H100 "
                              f"at 32K, 32 value heads (its matmul FLOPs only; fewer heads per device untimed"
                              f"{'; ' + ' and '.join(untimed) + ' at that rate too: untimed' if untimed else ''}"
                              f")")
    parts = {"attention_s": attention_s, "matmul_s": matmul_s, "matmul_fp8_s": fp8_s, "delta_rule_s": delta_s, "elementwise_s": elementwise_s,
             "update_s": update_s,
             "collectives_hidden_s": hidden_comm, "collectives_exposed_s": exposed_comm,
             "host_activations_s": activations_host_s, "host_optimizer_s": optimizer_host_s, "compute_s": compute_s}
    return {
        "step_seconds": step,
        "trust_band_seconds": (step * CALIBRATION_SPREAD[0], step * CALIBRATION_SPREAD[1]),
        "tokens_per_second_per_gpu": tokens / step / n,
        "mfu": p.flops_per_device / step / t.peak_flops,
        "attention_kernel": kernel,
        "parts": parts,
        "assumptions": assumptions,
    }
