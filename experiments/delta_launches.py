"""How many GPU kernels one forward + backward of the gated delta rule launches, per walk (``impl``), read from the
program compiled for a compile-only H100 (no GPU needed): a claim one can read, not a time.

    python experiments/delta_launches.py                        # 32K tokens, Qwen3.5-9B's 16 / 32 heads of 128
    python experiments/delta_launches.py --seq-len 131072 --heads 2,4

Counted from XLA's optimised HLO: every instruction that runs as a kernel (a fusion, a custom call such as a Pallas
kernel or a cuBLAS GEMM, a copy, a collective, ...; not parameters, tuples, bitcasts or the loops themselves) in every
computation that runs on its own (the entry, while bodies and conditions, branches), times how often it runs per call
(loop trips included, ``plan.hlo.multiplicities``). A while loop's condition is a kernel each trip too. Also: the
program's temporary memory (``memory_analysis``), and ptxas' figures of the Pallas kernels (registers, spills,
shared memory, ``wgmma``: ``plan.kernel_report``). The one GPU timing of the XLA walk (101.0 ms at 32K, 16 / 32 heads,
bf16 inputs, highest precision; ``experiments/results/gpu_h100_20261127/``) is printed beside its count, divided
per launch, so the reader can judge how much of it launches may explain; the Pallas walk is not timed.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only target needs the CUDA plugin not to start a GPU

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
        "after-all", "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain"}


def launches(hlo_text: str) -> tuple[int, collections.Counter]:
    """``(kernels launched per execution, the same by opcode or custom-call target)`` (module doc)."""
    from ulysses_jax.plan import hlo

    by_kind: collections.Counter = collections.Counter()
    for ins, times in hlo.executed(hlo_text):
        if ins.opcode in FREE or ins.opcode.endswith("-done"):
            continue
        kind = ins.opcode
        if kind == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
            kind = target.group(1) if target else kind
        by_kind[kind] += times
    by_kind = collections.Counter({k: int(round(n)) for k, n in by_kind.items()})  # whole launches per call
    return sum(by_kind.values()), by_kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 32))
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--precision", default="highest", choices=("highest", "bf16"))
    p.add_argument("--target", default="h100")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from ulysses_jax.kernels.gated_delta import gated_delta_rule
    from ulysses_jax.plan.kernel_report import dump_options, kernels
    from ulysses_jax.plan.targets import target_devices

    dev = target_devices(args.target, devices=1)[0]
    sh = SingleDeviceSharding(dev)
    (hk, hv), s, d = args.heads, args.seq_len, args.dim
    structs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)
               for shape in ((1, s, hk, d), (1, s, hk, d), (1, s, hv, d))]
    structs += [jax.ShapeDtypeStruct((1, s, hv), jnp.float32, sharding=sh)] * 2
    print(f"gated delta rule forward + backward, 1 x {s} tokens, {hk} / {hv} heads of {d}, bf16 inputs, "
          f"{args.precision} products, compiled for a compile-only {dev.device_kind}")
    for impl in ("xla", "pallas"):
        def loss(q, k, v, g, beta, impl=impl):
            o = gated_delta_rule(q, k, v, g, beta, impl=impl, interpret=False, precision=args.precision)
            return o.astype(jnp.float32).sum()

        with jax.default_device(dev), tempfile.TemporaryDirectory() as dump:
            lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*structs).lower()
            compiled = lowered.compile(compiler_options=dump_options(dump) if impl == "pallas" else None)
            found = kernels(dump, prefix="gated_delta_scan") if impl == "pallas" else []
        total, by_kind = launches(compiled.as_text())
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        top = ", ".join(f"{k} {n:,}" for k, n in by_kind.most_common(6))
        print(f"  {impl:6s} {total:8,} kernel launches per call; temp {temp:.2f} GiB; most: {top}")
        for k in found:  # ptxas' figures of the Pallas kernels (plan.kernel_report)
            print(f"         {k.name}: grid {k.grid}, {k.warps} warps, {k.shared_memory_bytes:,} B shared memory, "
                  f"{k.registers} registers, {k.spill_store_bytes} / {k.spill_load_bytes} B spilled (stores / loads), "
                  f"{k.wgmma} wgmma, {k.mma_sync} mma.sync")
        if impl == "xla" and (s, hk, hv, d, args.precision) == (32768, 16, 32, 128, "highest"):
            print(f"         measured on one H100 (2026-11-27): 101.0 ms, {101.0e3 / total:.1f} us per launch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
