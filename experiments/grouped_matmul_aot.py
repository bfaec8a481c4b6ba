"""Grouped matmul (MoE) compiled for one H100 with no GPU: ``jax.lax.ragged_dot`` vs our Pallas kernels.

No GPU needed and no time measured: with the CUDA plugin (the ``aot`` extra) XLA compiles forward + backward
(``jax.value_and_grad`` of a sum, gradients in x and w) for a compile-only H100 ("deviceless" AOT) and runs ptxas on
the Triton kernels itself. For each implementation this records, per device, the argument / output / temp bytes of
``memory_analysis()``, the custom calls in the optimised HLO and its largest array, and for the Pallas kernels the
launch (grid, warps, shared memory) from XLA's thunk sequence, registers / spills from ``ptxas -v`` on the dumped PTX
and the MMA instructions in the PTX (Hopper ``wgmma.mma_async`` or Ampere-style ``mma.sync``)
(``ulysses_jax.plan.kernel_report``).

Shapes: x bf16 [65536, 2048] (8,192 tokens routed to their top 8 of 128 experts), w bf16 [128, 2048, 768]. Group sizes
are traced, so they do not change the program; the top-k draw below only says how many of the static visit list's
entries such routing uses (how much the tiles that straddle groups add to the forward's work). Writes
``experiments/results/grouped_matmul_h100_aot.md``.

    python experiments/grouped_matmul_aot.py [--out-dir experiments/results]
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the CUDA plugin registers without a GPU

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from results_io import run_header  # noqa: E402  (beside this script)

TOKENS, TOP_K, EXPERTS, D_MODEL, D_FF = 8192, 8, 128, 2048, 768
M = TOKENS * TOP_K
NOTES = [
    "Per device, from `compiled.memory_analysis()` (XLA buffers only). The ragged_dot program needs more temp memory",
    "than an H100 has (80 GB): XLA lowers it to GEMMs over a masked [M, E * K] copy of x (the largest array below,",
    "32 GiB; the forward is that times w reshaped to [E * K, N]), E times the work of a grouped GEMM. The Pallas",
    "program's temp is the forward output y (96 MiB, for the sum) plus the group metadata. Kernels: grouped_matmul",
    "(forward), grouped_matmul_dx (dX = dy @ w[e]^T, the same kernel reading w transposed), grouped_matmul_dw",
    "(dW[e] = x_e^T @ dy_e). Figures from the compiled PTX; no kernel was run: nothing here says how fast it is.",
    "",
]
_CUSTOM = re.compile(r'custom_call_target="([^"]+)"')
_SHAPE = re.compile(r"\b(bf16|f32|f16|s32|pred)\[([\d,]+)\]")


def top_k_group_sizes(seed: int = 0):
    """Group sizes of ``TOKENS`` tokens each sent to its ``TOP_K`` best of ``EXPERTS`` experts (random logits)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((TOKENS, EXPERTS)) + rng.standard_normal(EXPERTS) * 0.5  # some experts favoured
    chosen = np.argsort(-logits, axis=1)[:, :TOP_K]
    return np.bincount(chosen.ravel(), minlength=EXPERTS).astype(np.int32)


def largest_array(hlo: str) -> str:
    """The HLO array shape with the most elements, e.g. ``bf16[65536,262144]``."""
    best = max(_SHAPE.finditer(hlo), key=lambda m: eval("*".join(m.group(2).split(",")) or "1"))
    return f"{best.group(1)}[{best.group(2)}]"


def compile_one(dev, impl: str, dump_dir: str):
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.kernels.grouped_matmul import grouped_matmul
    from ulysses_jax.plan.kernel_report import dump_options

    sh = SingleDeviceSharding(dev)
    args = (jax.ShapeDtypeStruct((M, D_MODEL), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((EXPERTS, D_MODEL, D_FF), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32, sharding=sh))

    def loss(x, w, gs):
        return grouped_matmul(x, w, gs, impl=impl, platform="gpu").astype(jnp.float32).sum()

    start = time.perf_counter()
    with jax.default_device(dev):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower()
    compiled = lowered.compile(compiler_options=dump_options(dump_dir))
    return compiled, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from ulysses_jax.kernels.grouped_matmul import default_block_sizes, group_bounds, num_visits, visits
    from ulysses_jax.plan.kernel_report import kernels
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices("h100", devices=1)[0]
    sizes = top_k_group_sizes()
    bm = default_block_sizes(jnp.bfloat16).block_m
    listed = visits(group_bounds(jnp.asarray(sizes), M), M, bm)
    used = int((listed[3] > listed[2]).sum())
    tiles = M // bm
    lines = [f"group sizes (top-{TOP_K} of {EXPERTS}, seed 0): min {sizes.min()}, max {sizes.max()}, "
             f"{(sizes == 0).sum()} empty; forward visits used {used} of {num_visits(M, EXPERTS, bm)} listed "
             f"({tiles} row tiles of {bm}: {used / tiles - 1:.1%} more tile work than a dense GEMM of M rows)"]
    print(lines[0])
    rows, kernel_rows = [], []
    for impl in ("ragged_dot", "pallas"):
        with tempfile.TemporaryDirectory() as dump:
            compiled, seconds = compile_one(dev, impl, dump)
            mem = compiled.memory_analysis()
            hlo = compiled.as_text()
            calls = collections.Counter(_CUSTOM.findall(hlo))
            row = {"impl": impl, "argument bytes": f"{mem.argument_size_in_bytes:,}",
                   "output bytes": f"{mem.output_size_in_bytes:,}", "temp bytes": f"{mem.temp_size_in_bytes:,}",
                   "custom calls": ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())) or "none",
                   "largest HLO array": largest_array(hlo), "host compile s (CPU, not a GPU time)": f"{seconds:.1f}"}
            rows.append(row)
            print(row)
            if impl == "pallas":
                for k in kernels(dump, prefix="grouped_matmul"):
                    kernel_rows.append({
                        "kernel": k.name, "grid": "x".join(map(str, k.grid)), "warps": k.warps,
                        "shared memory bytes": f"{k.shared_memory_bytes:,}", "registers": k.registers,
                        "spill store / load bytes": f"{k.spill_store_bytes} / {k.spill_load_bytes}",
                        "wgmma": k.wgmma, "wgmma shapes": " ".join(k.wgmma_shapes), "mma.sync": k.mma_sync,
                        "cp.async": k.cp_async, "TMA": k.tma, "blocks/SM": k.resident_blocks})
                    print(kernel_rows[-1])

    meta = run_header(hardware="compile-only H100 (deviceless AOT on a CPU machine), no GPU; time not measured",
                      shapes=f"x bf16 [{M}, {D_MODEL}], w bf16 [{EXPERTS}, {D_MODEL}, {D_FF}], group_sizes int32 "
                             f"[{EXPERTS}]; forward + backward (jax.value_and_grad of a sum, gradients in x and w)",
                      blocks=str(default_block_sizes(jnp.bfloat16)))
    out = pathlib.Path(args.out_dir) / "grouped_matmul_h100_aot.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ["# Grouped matmul (MoE) on a compile-only H100: jax.lax.ragged_dot vs the Pallas kernels", ""]
    text += [f"- {k}: `{v}`" for k, v in meta.items()] + [f"- {lines[0]}", ""] + NOTES
    for table in (rows, kernel_rows):
        cols = list(table[0])
        text += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        text += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in table] + [""]
    out.write_text("\n".join(text))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
