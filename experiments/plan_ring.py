"""Ulysses x ring vs Ulysses alone for Llama-3.1-8B on 32 and 64 H100s (8 per host), from `ulysses-jax plan`.

    python experiments/plan_ring.py                       # the table of experiments/results/plan_ring_llama8b.md
    python experiments/plan_ring.py --only ring4xsp8 --no-search
    python experiments/plan_ring.py --only ring4xsp8-pallas sp32 ring8xsp8-pallas --out experiments/results/plan_ring_llama8b_pallas

Per mesh: the longest context that fits (skipped with --no-search), and at one common length
(--seq-len, default 1M tokens) the bytes per device per step over NVLink (collectives whose groups stay in one host)
and over the network (the others), read from the compiled H100 program, with the collective-permutes' async
start/done pairs and how many have compute scheduled inside. Settings as experiments/plan_max_context.py: float32
parameters and AdamW state sharded over all devices, bf16 compute, loss and MLP tiled in 4096-token chunks, batch 1,
remat offload; attention: our Pallas kernel for Ulysses alone, per row the blockwise or the Pallas kernel for the
ring steps. Compile-only: no time is measured.
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
from ulysses_jax.plan.search import seq_len_unit  # noqa: E402
from ulysses_jax.train.devices import MeshConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    devices: int
    ring: int
    sp: int
    start: int  # the second length the search tries (after the common one): near the expected limit
    attention: str = "pallas"  # the local kernel (of each ring step, with a ring)

    @property
    def hosts(self) -> int:
        return self.devices // 8


ROWS = [  # Ulysses alone cannot take 64 GPUs for one sequence: sp is at most the 32 query heads
    Row("ring4xsp8", 32, 4, 8, 7_000_000, "blockwise"),
    Row("ring4xsp8-pallas", 32, 4, 8, 12_000_000),
    Row("sp32", 32, 1, 32, 7_000_000),
    Row("ring8xsp8", 64, 8, 8, 14_000_000, "blockwise"),
    Row("ring8xsp8-pallas", 64, 8, 8, 19_000_000),
]


def config(row: Row, seq_len: int) -> PlanConfig:
    return PlanConfig(
        preset="llama3.1-8b", seq_len=seq_len, batch_size=1,
        mesh=MeshConfig(fsdp=-1, ring=row.ring, sp=row.sp), attention=row.attention,
        remat="offload", loss_chunk=4096, mlp_chunk=4096, target="h100", devices=row.devices, hosts=row.hosts,
        kernels=False,
    )


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def longest_context(row: Row, first) -> str:
    """The longest length that fits, by secant steps on memory vs length (memory is close to linear in the length,
    so 3-5 compiles bracket the limit to one unit where ``find_max_seq_len``'s bisection takes about 10; each
    compile takes minutes on this 2-core machine). ``first``: the plan at the common length, one point of the line."""
    unit = seq_len_unit(config(row, 0), row.ring * row.sp)
    points = {first.seq_len // unit: first}
    n = row.start // unit
    for _ in range(6):
        p = points.get(n) or plan(config(row, n * unit), with_kernels=False, detail=False)
        points[n] = p
        print(f"[{row.name}] {n * unit:,}: {gib(p.memory['total_bytes'])} GiB ({'fits' if p.fits else 'over'})",
              flush=True)
        fit = max((k for k, q in points.items() if q.fits), default=0)
        over = min((k for k, q in points.items() if not q.fits), default=None)
        if over is not None and over - fit <= 1:
            break
        (a, pa), (b, pb) = sorted(points.items())[-2:] if over is None else ((fit, points[fit]), (over, points[over]))
        slope = (pb.memory["total_bytes"] - pa.memory["total_bytes"]) / max(b - a, 1)
        budget = pb.memory["budget_bytes"]
        n = int(a + (budget - pa.memory["total_bytes"]) / max(slope, 1))
        n = min(max(n, fit + 1), over - 1) if over is not None else max(n, fit + 1)
    fit = max((k for k, q in points.items() if q.fits), default=0)
    over = min((k for k, q in points.items() if not q.fits), default=None)
    note = "" if over is None else f"; {over * unit:,} over ({gib(points[over].memory['total_bytes'])} GiB)"
    return f"{fit * unit:,} ({gib(points[fit].memory['total_bytes'])} GiB{note})" if fit else f"none{note}"


def measure(row: Row, seq_len: int, search: bool) -> dict:
    t0 = time.time()
    p = plan(config(row, seq_len), with_kernels=False, detail=False)
    longest = longest_context(row, p) if search else "not searched"
    intra = sum(c.intra_host_bytes for c in p.collectives.values())
    inter = sum(c.inter_host_bytes for c in p.collectives.values())
    cp = p.collectives.get("collective-permute")
    by_kind = "; ".join(f"{k} {c.count} x, {gib(c.intra_host_bytes)} / {gib(c.inter_host_bytes)}"
                        for k, c in sorted(p.collectives.items()))
    return {
        "H100s (hosts)": f"{row.devices} ({row.hosts})",
        "mesh": " x ".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1),
        "attention": config(row, seq_len).attention,
        "longest context (GiB/device)": longest,
        f"GiB/device at {seq_len:,}": gib(p.memory["total_bytes"]),
        f"NVLink GiB/step at {seq_len:,}": gib(intra),
        f"network GiB/step at {seq_len:,}": gib(inter),
        "permutes: count, async pairs, overlapped": "-" if cp is None else f"{cp.count}, {cp.async_pairs}, "
                                                                            f"{cp.overlapped}",
        "per kind: count, NVLink / network GiB": by_kind,
        "compile s": f"{time.time() - t0:.0f}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="rows to run, by name: " + ", ".join(r.name for r in ROWS))
    ap.add_argument("--seq-len", type=int, default=1_048_576, help="the common length of the byte comparison")
    ap.add_argument("--no-search", action="store_true", help="skip the search for the longest context")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "plan_ring_llama8b"))
    args = ap.parse_args(argv)
    meta = run_header(hardware="compile-only H100 (deviceless AOT on a CPU machine; no GPU)",
                      reference="ALST (Arctic Long Sequence Training) published 15M tokens for Llama-8B on 32 H100s")
    results = []
    for row in [r for r in ROWS if not args.only or r.name in args.only]:
        results.append(measure(row, args.seq_len, not args.no_search))
        print(results[-1], flush=True)
        write_table(args.out, "Llama-3.1-8B: Ulysses x ring vs Ulysses alone on H100s (ulysses-jax plan)", meta,
                    list(results[0]), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
