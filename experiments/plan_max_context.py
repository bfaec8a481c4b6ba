"""The longest context that trains, per model and GPU count, from `ulysses-jax plan --find-max-seq-len`.

    python experiments/plan_max_context.py                  # the table of experiments/results/plan_max_context_h100.md
    python experiments/plan_max_context.py --only llama3.1-8b/8/offload
    python experiments/plan_max_context.py --collectives    # also: collectives per layer of Llama-3.1-8B at 32K

Each row compiles the real train step for compile-only H100s (deviceless AOT, no GPU needed; the CUDA plugin of
the aot extra) and bisects over sequence lengths; "fits" means XLA's per-device total is within 90% of the
H100's 79.11 GiB. Settings: float32 parameters and AdamW state sharded over all devices, bf16 compute, our
Pallas attention, loss and MLP tiled in chunks of 4096 tokens, batch 1. Time is not measured: there is no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from results_io import run_header, write_table  # noqa: E402  (beside this script)

from ulysses_jax.plan.planner import GiB, PlanConfig, plan  # noqa: E402
from ulysses_jax.plan.search import find_max_seq_len  # noqa: E402
from ulysses_jax.train.devices import MeshConfig  # noqa: E402
from ulysses_jax.train.step import OptimConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Row:
    preset: str
    devices: int
    remat: str
    start: int  # first length tried (near the expected answer: fewer compiles)
    sp: int | None = None  # default: min(devices, 8)
    hosts: int = 1
    optim_offload: bool = False  # bfloat16 parameters; float32 master weights and AdamW state in pinned host memory
    remat_every: int = 1  # keep the input of every k-th layer only (ModelConfig.remat_every)
    attn_chunk: int = 0  # the tiled attention sublayer (ModelConfig.attn_chunk)
    attn_head_chunk: int = 0  # its query heads per group on each device (ModelConfig.attn_head_chunk)
    attn_recompute: bool = False  # no attention output kept for the backward (ModelConfig.attn_recompute)
    mlp_chunk: int = 4096  # the tiled MLP (0: off)

    @property
    def key(self) -> str:
        every = f"/every{self.remat_every}" if self.remat_every > 1 else ""
        return (f"{self.preset}/{self.devices}/{self.remat}{every}" + ("+optim-offload" if self.optim_offload else "")
                + (f"+attn-chunk{self.attn_chunk}" if self.attn_chunk else "")
                + (f"+heads{self.attn_head_chunk}" if self.attn_head_chunk else "")
                + ("+recompute" if self.attn_recompute else "") + ("" if self.mlp_chunk else "+mlp-whole"))


ROWS = [
    Row("llama3.1-8b", 1, "offload", 32768),
    Row("llama3.1-8b", 1, "offload", 430_080, optim_offload=True),
    Row("llama3.1-8b", 8, "full", 1_343_488),
    Row("llama3.1-8b", 8, "full", 2_555_904, remat_every=4),
    Row("llama3.1-8b", 8, "offload", 4_194_304),
    Row("llama3.1-8b", 8, "offload", 5_079_040, optim_offload=True),
    Row("qwen3-4b", 4, "full", 524_288),
    Row("qwen3-4b", 4, "offload", 2_097_152),
    Row("llama3.2-1b", 8, "full", 2_097_152),
    Row("llama3.2-1b", 8, "offload", 8_388_608),
    Row("llama3.2-1b", 8, "offload", 12_288_000, optim_offload=True),
    Row("qwen3-4b", 8, "offload", 4_194_304, optim_offload=True),
    Row("qwen3-8b", 1, "offload", 262_144, optim_offload=True),
    # the tiled attention sublayer (and the MLP sublayer's norm and residual inside its chunks)
    Row("llama3.1-8b", 8, "offload", 8_388_608, optim_offload=True, attn_chunk=4096),
    Row("llama3.1-8b", 8, "offload", 7_864_320, optim_offload=True, attn_chunk=4096, remat_every=2),  # host < 237 GiB
    Row("llama3.1-8b", 1, "offload", 524_288, optim_offload=True, attn_chunk=4096),
    Row("llama3.1-8b", 8, "offload", 6_291_456, attn_chunk=4096),
    Row("llama3.2-1b", 8, "offload", 16_777_216, optim_offload=True, attn_chunk=4096),
    # ... in head groups (heads per group on each device; Llama-3.1-8B has 32 on one GPU, 4 on each of 8)
    Row("llama3.1-8b", 1, "offload", 1_048_576, optim_offload=True, attn_chunk=4096, attn_head_chunk=4),
    Row("llama3.1-8b", 1, "offload", 1_048_576, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("llama3.1-8b", 1, "offload", 1_048_576, optim_offload=True, attn_chunk=4096, attn_head_chunk=4,
        attn_recompute=True),
    Row("llama3.1-8b", 8, "offload", 8_388_608, optim_offload=True, attn_chunk=4096, attn_head_chunk=1,
        remat_every=2),  # host < 237 GiB per GPU
    Row("llama3.1-8b", 8, "offload", 8_388_608, optim_offload=True, attn_chunk=4096, attn_head_chunk=1,
        remat_every=2, attn_recompute=True),
    Row("llama3.1-8b", 8, "offload", 9_142_272, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("llama3.1-8b", 1, "offload", 1_286_144, optim_offload=True, attn_chunk=4096, attn_head_chunk=1,
        attn_recompute=True),
    Row("llama3.2-1b", 1, "offload", 4_194_304, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("llama3.2-1b", 8, "offload", 25_165_824, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("qwen3-4b", 1, "offload", 1_572_864, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("qwen3-4b", 8, "offload", 12_582_912, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("qwen3-8b", 1, "offload", 1_048_576, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    Row("qwen3-8b", 8, "offload", 9_437_184, optim_offload=True, attn_chunk=4096, attn_head_chunk=1),
    # Gemma 3 (29 local layers of 1,024 tokens, 5 global): the MLP whole, then tiled (its post-norm in each chunk);
    # the attention sublayer whole in these rows
    Row("gemma3-4b", 1, "offload", 131_072, optim_offload=True, mlp_chunk=0),
    Row("gemma3-4b", 8, "offload", 1_048_576, optim_offload=True, mlp_chunk=0),
    Row("gemma3-4b", 1, "offload", 360_448, optim_offload=True),
    Row("gemma3-4b", 8, "offload", 3_145_728, optim_offload=True),
]


def config(row: Row, seq_len: int) -> PlanConfig:
    sp = row.sp or min(row.devices, 8)
    return PlanConfig(
        preset=row.preset, seq_len=seq_len, batch_size=1, mesh=MeshConfig(fsdp=-1, sp=sp), attention="pallas",
        remat=row.remat, loss_chunk=4096, mlp_chunk=row.mlp_chunk, attn_chunk=row.attn_chunk,
        attn_head_chunk=row.attn_head_chunk,
        attn_recompute=row.attn_recompute, target="h100", devices=row.devices, hosts=row.hosts,
        kernels=False, param_dtype="bfloat16" if row.optim_offload else None, remat_every=row.remat_every,
        optim=OptimConfig(master_weights=row.optim_offload, offload=row.optim_offload),
    )


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def max_context(row: Row) -> dict:
    t0 = time.time()
    p = find_max_seq_len(config(row, row.start), log=lambda msg: print(f"[{row.key}]{msg}", flush=True))
    b, m = p.breakdown, p.memory
    top = "; ".join(f"{gib(n)} GiB {shapes[:70]}" for n, shapes in p.buffers[:3])
    return {
        "model": row.preset, "H100s": row.devices, "mesh": " x ".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1)
        or "1 device", "remat": row.remat + (f", every {row.remat_every}" if row.remat_every > 1 else ""),
        "attention": (f"tiled, {row.attn_chunk}" + (f", {row.attn_head_chunk} heads per group" if row.attn_head_chunk
                                                    else "") + (", recompute" if row.attn_recompute else "")
                      if row.attn_chunk else "whole"),
        "optimizer": "host (bf16 params, f32 master)" if row.optim_offload
        else "device (f32 params)", "longest context": f"{p.max_seq_len:,}",
        "total GiB": gib(m["total_bytes"]), "params GiB": gib(b["parameters"]), "optimizer GiB": gib(b["optimizer"]),
        "activations+temps GiB": gib(b["activations"]), "host GiB per GPU": gib(m["host_bytes"]),
        "largest buffers at the limit": top, "search s": f"{time.time() - t0:.0f}",
    }


def collectives_per_layer() -> list[dict]:
    p = plan(config(Row("llama3.1-8b", 8, "full", 32768), 32768))
    layers = 32
    rows = []
    for kind, c in sorted(p.collectives.items()):
        rows.append({
            "collective": kind, "per step": c.count, "per layer": f"{c.count / layers:.2f}",
            "GiB per step": gib(c.bytes), "MiB per layer": f"{c.bytes / layers / 2**20:.1f}",
            "async pairs": c.async_pairs, "overlapping compute": c.overlapped,
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="rows to run, as preset/devices/remat[/everyK][+optim-offload]")
    ap.add_argument("--collectives", action="store_true", help="also the collectives of Llama-3.1-8B at 32K")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if not args.only or r.key in args.only]
    meta = run_header(hardware="compile-only NVIDIA H100 80GB HBM3 (deviceless AOT on a CPU machine; no GPU)")
    results = [max_context(r) for r in rows]
    cols = list(results[0]) if results else []
    if results:
        write_table(os.path.join(args.out_dir, "plan_max_context_h100"), "Longest trainable context on H100s "
                    "(ulysses-jax plan --find-max-seq-len)", meta, cols, results)
    if args.collectives:
        coll = collectives_per_layer()
        write_table(os.path.join(args.out_dir, "plan_collectives_llama8b_32k"), "Collectives of the Llama-3.1-8B "
                    "train step at 32K on 8 H100s (sp=8, remat full), from the GPU HLO", meta, list(coll[0]), coll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
