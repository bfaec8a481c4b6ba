"""The step-time estimate of `ulysses-jax plan` beside published runs: same model, context and GPU count.

    python experiments/plan_calibration.py            # experiments/results/plan_calibration_h100.md
    python experiments/plan_calibration.py --only trl
    python experiments/plan_calibration.py --attention pallas   # our kernel: ..._h100_pallas.md

Each row compiles our train step for compile-only H100s with the memory tools named in the row (or chooses them with
`--memory auto`) and reads the plan's *estimate* (plan/estimate.py: a model of the step, not a measurement of these
rows; its rates are calibrated on the single-GPU steps this project measured, experiments/results/plan_vs_measured_h100.md). The published figures are others' measured runs, with their own kernels and methods: the row
says which. The published figures come from the project's anchors notes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from results_io import run_header, write_table  # noqa: E402  (beside this script)

from ulysses_jax.plan.planner import PlanConfig, plan  # noqa: E402
from ulysses_jax.plan.search import auto_fit  # noqa: E402
from ulysses_jax.train.devices import MeshConfig  # noqa: E402
from ulysses_jax.train.step import OptimConfig  # noqa: E402

CHUNKS = dict(loss_chunk=4096, mlp_chunk=4096)
HOST_OPT = dict(param_dtype="bfloat16", optim=OptimConfig(master_weights=True, offload=True))


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    peer: str
    preset: str
    devices: int
    seq_len: int
    published: str  # the published figure, as published
    published_tps_gpu: float | None  # ... as tokens/s per GPU where it converts
    method: str  # their kernels and method, against ours
    tools: dict  # our memory tools (PlanConfig fields); {"memory": "auto"} lets the planner choose


ROWS = [
    Row("trl", "TRL v1.13 ring CP (FSDP2)", "qwen3-8b", 8, 1_048_576, "380 s/step", 1_048_576 / 380 / 8,
        "theirs: ring attention (FlashAttention), FSDP2, bf16, full attention, no packing; ours: Ulysses sp=8, packed rows "
        "with segment ids", dict(memory="auto")),
    *(Row(f"torchtitan-{s // 1024}k", "torchtitan CP (ring)", "llama3.1-8b", 8, s, f"{tps:,} tok/s/GPU", tps,
          "theirs: ring CP, Float8 matmuls, full activation checkpointing, FSDP2; ours: Ulysses sp=8, bf16 matmuls, "
          "--remat full, tiled loss and MLP", dict(remat="full", **CHUNKS))
      for s, tps in ((32768, 3890), (131072, 1071), (262144, 548))),
    *(Row(f"hf-blog-{s // 1024}k", "HF blog (Accelerate + DeepSpeed Ulysses)", "qwen3-4b", 4, s, f"{tps:,} tok/s",
          tps / 4, "theirs: DeepSpeed Ulysses SP=4, ZeRO-3, optimizer on the CPU (CPU Adam), FlashAttention; figure "
          "read as the 4 GPUs' total (per GPU = /4); ours: sp=4, --remat full, AdamW streamed through the GPU "
          "from pinned host memory", dict(remat="full", **CHUNKS, **HOST_OPT))
      for s, tps in ((32768, 7872), (65536, 13396))),
]


def config(row: Row, attention: str) -> PlanConfig:
    return PlanConfig(preset=row.preset, seq_len=row.seq_len, batch_size=1, devices=row.devices,
                      mesh=MeshConfig(fsdp=1, sp=row.devices), attention=attention, kernels=False, **row.tools)


def measure(row: Row, attention: str) -> dict:
    cfg = config(row, attention)
    p = auto_fit(cfg, log=lambda m: print(f"[{row.key}] {m}", flush=True)) if cfg.memory == "auto" else plan(
        cfg, detail=False)
    e = p.estimate
    ratio = e["tokens_per_second_per_gpu"] / row.published_tps_gpu if row.published_tps_gpu else None
    return {"run": row.peer, "model": row.preset, "H100s": row.devices, "context": f"{row.seq_len:,}",
            "published": row.published, "published tok/s/GPU": f"{row.published_tps_gpu:,.0f}",
            "estimate s/step": f"{e['step_seconds']:.2f}",
            "estimate tok/s/GPU": f"{e['tokens_per_second_per_gpu']:,.0f}",
            "estimate MFU": f"{e['mfu']:.1%}", "estimate / published": f"{ratio:.2f}" if ratio else "-",
            "fits": "yes" if p.fits else "NO", "our kernel": e["attention_kernel"],
            "our re-runs": next((a.split("; ", 1)[1] for a in e["assumptions"] if a.startswith("other matmuls")), ""),
            "our memory tools": p.memory_flags or " ".join(
                a for a in p.train_args if a.startswith("--remat") or a.startswith("--optim.") or a in (
                    "--param-dtype", "bfloat16", "full", "offload")), "differences": row.method}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--attention", default="auto", help="auto (cuDNN on GPUs, packed rows too) or pallas (ours)")
    args = ap.parse_args(argv)
    name = "plan_calibration_h100" + ("" if args.attention == "auto" else f"_{args.attention}")
    meta = run_header(hardware="compile-only NVIDIA H100 80GB HBM3 (deviceless AOT on a CPU machine; no GPU)")
    results = []
    for row in ROWS:
        if args.only and not any(row.key.startswith(o) for o in args.only):
            continue
        results.append(measure(row, args.attention))
        print(results[-1], flush=True)
        write_table(os.path.join(args.out_dir, name), "The plan's step-time estimate vs published "
                    "runs (an estimate of ours, calibrated on our single-GPU steps)", meta, list(results[0]), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
