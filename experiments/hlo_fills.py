"""What a compiled step writes only to fill or move buffers: zero fills, slice updates and copies, per step.

    ulysses-jax plan --preset llama3.2-1b --seq-len 32768 ... --hlo-out scanned.hlo
    ulysses-jax plan --preset llama3.2-1b --seq-len 32768 ... --scan-unroll --hlo-out unrolled.hlo
    python experiments/hlo_fills.py scanned.hlo unrolled.hlo

Reads the optimised HLO that ``plan --hlo-out`` writes and counts, for each program, the instructions that run per
step (``plan.hlo.executed``: loop bodies times their trip counts) whose work is a fill or a move rather than
arithmetic, by opcode or by the name XLA gives the fusion:

* ``zero fills``: broadcasts of a constant (fusions XLA names ``*broadcast*``, broadcasts outside fusions), e.g. the
  stacked buffers a layer loop writes what each layer saves into;
* ``slice updates``: ``dynamic-update-slice`` (and fusions named for it), e.g. a layer's saved values written into
  such a buffer; in place on a GPU, so the bytes moved are the slice's, not the buffer's: only counted;
* ``copies``: ``copy`` and fusions named ``*copy*`` or ``*transpose*`` (a buffer laid out again).

Beside them, ``all kernels``: every instruction that runs as a kernel or a copy (not parameters, constants, tuples,
bitcasts or the loops and calls that hold other instructions), so that what a change adds elsewhere shows too. Bytes
are each result's size times its runs (a slice update's result is its whole buffer: left out of the total). No time is
claimed: this reads the program; a GPU's profile (``profile_step.py``) says what the fills cost.
"""

from __future__ import annotations

import argparse
import collections

from ulysses_jax.plan import hlo

KINDS = ("zero fills", "slice updates", "copies", "all kernels")
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "partition-id", "replica-id", "opt-barrier"}


def kind(ins) -> str | None:
    """The kind of fill or move ``ins`` is (``KINDS``), or None."""
    name = ins.name.split(".")[0]
    if ins.opcode == "dynamic-update-slice" or (ins.opcode == "fusion" and "dynamic_update_slice" in name):
        return "slice updates"
    if ins.opcode == "broadcast" or (ins.opcode == "fusion" and "broadcast" in name):
        return "zero fills"
    if ins.opcode == "copy" or (ins.opcode == "fusion" and ("copy" in name or "transpose" in name)):
        return "copies"
    return None


def fills(text: str) -> dict[str, tuple[float, float]]:
    """``{kind: (runs per step, GiB written per step)}`` of a compiled step's HLO text."""
    runs, written = collections.Counter(), collections.Counter()
    for ins, times in hlo.executed(text):
        if ins.opcode in NO_KERNEL:
            continue
        k, gib = kind(ins), times * hlo.array_bytes(ins.type) / 2**30
        for key in (k, "all kernels") if k is not None else ("all kernels",):
            runs[key] += times
            written[key] += 0 if k == "slice updates" else gib
    return {k: (runs[k], written[k]) for k in KINDS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", nargs="+", help="HLO text files (plan --hlo-out)")
    args = p.parse_args(argv)
    print(f"| program | {' | '.join(f'{k}: runs, GiB' for k in KINDS)} |")
    print(f"|---|{'---|' * len(KINDS)}")
    for path in args.hlo:
        with open(path) as f:
            counts = fills(f.read())
        cells = " | ".join(f"{runs:,.0f}, {'in place' if k == 'slice updates' else f'{gib:.2f}'}"
                           for k, (runs, gib) in counts.items())
        print(f"| {path} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
