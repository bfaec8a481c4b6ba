"""What a compiled step's kernels other than GEMMs and attention move per step, by the op they compute: two programs
side by side (e.g. the same step without and with --fp8), the ops that differ most first.

    ulysses-jax plan --preset llama3.1-8b --seq-len 8192 --lora-rank 16 ... --hlo-out bf16.hlo
    ulysses-jax plan --preset llama3.1-8b --seq-len 8192 --lora-rank 16 ... --fp8 --hlo-out fp8.hlo
    python experiments/hlo_traffic.py bf16.hlo fp8.hlo --top 12

Reads the optimised HLO that ``plan --hlo-out`` writes. Every instruction that runs per step (``plan.hlo.executed``:
loop bodies times their trip counts) as a kernel, but matmuls, custom calls (cuDNN attention, Pallas kernels),
collectives and host transfers, is counted by the bytes it reads and writes (``plan.traffic.moved_bytes``): its result,
and each operand whole, except an operand that the fused computation only slices (its slices are read) and the
buffer a slice update writes into in place (the update alone is written); ``plan``'s estimate times their sum
(``plan.traffic.kernel_bytes``). Rows are keyed by the op name XLA kept from JAX (the last three parts of ``op_name``,
the loop and ``jit(step)`` prefixes dropped). Bytes over a bandwidth are an ESTIMATE of time (the kernels as
memory-bound, at ``--bandwidth``: 4.3 TB/s is a device copy measured on an H200); a GPU's profile
(``profile_step.py``) says what they take.
"""

from __future__ import annotations

import argparse
import collections
import re

from ulysses_jax.plan import traffic as plan_traffic


def _key(ins) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    if m is None:
        return ins.opcode
    parts = [p for p in m.group(1).split("/") if p not in ("jit(step)", "while", "body")]
    return "/".join(parts[-3:])


def traffic(text: str) -> dict[str, tuple[float, float]]:
    """``{op: (runs per step, GiB moved per step)}`` of the kernels ``plan.traffic.kernel_bytes`` counts (not matmuls,
    attention, other custom calls, collectives or host transfers): their sum is its total."""
    runs, gib = collections.Counter(), collections.Counter()
    for ins, times, moved in plan_traffic.kernels(text):
        key = _key(ins)
        runs[key] += times
        gib[key] += times * moved / 2**30
    return {k: (runs[k], gib[k]) for k in gib}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="HLO text (plan --hlo-out)")
    p.add_argument("after", help="HLO text of the other program")
    p.add_argument("--top", type=int, default=12, help="rows: the ops whose bytes differ most")
    p.add_argument("--bandwidth", type=float, default=4.3, help="TB/s for the time ESTIMATE (H200 copy: 4.3)")
    args = p.parse_args(argv)
    with open(args.before) as f, open(args.after) as g:
        a, b = traffic(f.read()), traffic(g.read())
    ms = lambda x: x * 2**30 / (args.bandwidth * 1e12) * 1e3  # noqa: E731
    ta, tb = (sum(v[1] for v in t.values()) for t in (a, b))
    print(f"moved a step by kernels but GEMMs and attention: {ta:.1f} -> {tb:.1f} GiB ({tb - ta:+.1f}; "
          f"an ESTIMATE of {ms(tb - ta):+.1f} ms at {args.bandwidth} TB/s)\n")
    print("| op | runs | GiB before | GiB after | difference |\n|---|---|---|---|---|")
    zero = (0, 0.0)
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, zero)[1] - a.get(k, zero)[1]))[:args.top]:
        (ra, ga), (rb, gb) = a.get(k, zero), b.get(k, zero)
        print(f"| `{k}` | {ra:,.0f} -> {rb:,.0f} | {ga:.2f} | {gb:.2f} | {gb - ga:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
