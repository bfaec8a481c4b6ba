"""What a compiled step writes only to fill or move buffers: zero fills, slice updates and copies, per step.

    ulysses-jax plan --preset llama3.2-1b --seq-len 32768 ... --hlo-out scanned.hlo
    ulysses-jax plan --preset llama3.2-1b --seq-len 32768 ... --scan-unroll --hlo-out unrolled.hlo
    python experiments/hlo_fills.py scanned.hlo unrolled.hlo

Reads the optimised HLO that ``plan --hlo-out`` writes and counts, for each program, the instructions that run per
step (``plan.hlo.executed``: loop bodies times their trip counts) whose work is a fill or a move rather than
arithmetic, by what they compute (a fusion by the root of its fused computation, a tuple's elements each):

* ``zero fills``: broadcasts of a constant (copied or not), e.g. the stacked buffers a layer loop writes what each
  layer saves into;
* ``slice updates``: ``dynamic-update-slice``, e.g. a layer's saved values written into such a buffer (in place: the
  bytes written are the update's, not the buffer's);
* ``copies``: ``copy`` and ``transpose`` (a buffer laid out again).

Beside them, ``all kernels``: every instruction that runs as a kernel or a copy (not parameters, constants, tuples,
bitcasts or the loops and calls that hold other instructions), so that what a change adds elsewhere shows too. Bytes
are what each writes (its result; a slice update's update) times its runs. No time is claimed: this reads the
program; a GPU's profile (``profile_step.py``) says what the fills cost.
"""

from __future__ import annotations

import argparse
import collections
import re

from ulysses_jax.plan import hlo, traffic

KINDS = ("zero fills", "slice updates", "copies", "all kernels")
NO_KERNEL = traffic.NO_KERNEL


def _roots(ins, comps: dict, instrs: dict) -> list:
    """What ``ins`` computes: a fusion's fused root (a tuple's elements), else ``ins`` itself."""
    if ins.opcode != "fusion" or (m := re.search(r"calls=%([\w.\-]+)", ins.attrs)) is None:
        return [ins]
    root = comps[m.group(1)][-1]  # HLO text ends a computation with its ROOT
    return [instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]


def kind(root, instrs: dict) -> str | None:
    """The kind of fill or move a root computes (``KINDS``), or None."""
    if root.opcode == "dynamic-update-slice":
        return "slice updates"
    source = root
    while source.opcode in ("copy", "bitcast", "transpose"):  # a fill laid out again is still a fill
        source = instrs[source.operands[0]]
    if source.opcode == "broadcast" and all(instrs[o].opcode == "constant" for o in source.operands):
        return "zero fills"
    if root.opcode in ("copy", "transpose"):
        return "copies"
    return None


def written(root, instrs: dict) -> int:
    """Bytes a root writes: its result, or a slice update's update."""
    return hlo.array_bytes((instrs[root.operands[1]] if root.opcode == "dynamic-update-slice" else root).type)


def fills(text: str) -> dict[str, tuple[float, float]]:
    """``{kind: (runs per step, GiB written per step)}`` of a compiled step's HLO text."""
    comps, _ = hlo.parse(text)
    instrs = {i.name: i for body in comps.values() for i in body}  # instruction names are the module's, unique
    runs, gib = collections.Counter(), collections.Counter()
    for ins, times in hlo.executed(text):
        if ins.opcode in NO_KERNEL:
            continue
        roots = [(root, kind(root, instrs)) for root in _roots(ins, comps, instrs)]
        for k in {"all kernels", *(k for _, k in roots if k is not None)}:
            runs[k] += times
        for root, k in roots:
            size = times * written(root, instrs) / 2**30
            gib["all kernels"] += size
            if k is not None:
                gib[k] += size
    return {k: (runs[k], gib[k]) for k in KINDS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", nargs="+", help="HLO text files (plan --hlo-out)")
    args = p.parse_args(argv)
    print(f"| program | {' | '.join(f'{k}: runs, GiB' for k in KINDS)} |")
    print(f"|---|{'---|' * len(KINDS)}")
    for path in args.hlo:
        with open(path) as f:
            counts = fills(f.read())
        cells = " | ".join(f"{runs:,.0f}, {gib:.2f}" for runs, gib in counts.values())
        print(f"| {path} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
