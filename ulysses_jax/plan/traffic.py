"""What a compiled program's kernels move: the bytes per step that the kernels other than matmuls, attention,
collectives and host transfers read and write (elementwise work, reductions, copies, fills, slice updates), read from
its optimised HLO text. ``plan``'s estimate times them at a share of the HBM bandwidth (``estimate.py``);
``experiments/hlo_traffic.py`` lists them by op.
"""

from __future__ import annotations

import re
from collections import defaultdict

from ulysses_jax.plan.hlo import KINDS, Instr, array_bytes, executed, parse

# instructions that launch no kernel of their own, and those whose time the estimate counts elsewhere: collectives
# and host transfers (links: every asynchronous pair, e.g. a slice update into pinned host memory, and any result in
# host memory, layout memory space S(5)), custom calls (cuBLAS and cuDNN GEMMs and attention, Pallas kernels: their
# own rates)
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "partition-id", "replica-id", "opt-barrier"}
COUNTED_ELSEWHERE = (*KINDS, "send", "recv", "custom-call")
_ASYNC = ("-start", "-update", "-done")


def _fused(ins: Instr, comps: dict[str, list[Instr]]) -> list[Instr] | None:
    """The fused computation a fusion runs, or None for any other instruction."""
    m = re.search(r"calls=%([\w.\-]+)", ins.attrs) if ins.opcode == "fusion" else None
    return None if m is None else comps[m.group(1)]


def counted_elsewhere(ins: Instr, instrs: dict[str, Instr]) -> bool:
    """Whether ``ins`` is timed apart from the kernels ``kernel_bytes`` counts: a collective, a custom call, or a host
    transfer (an asynchronous pair, or a result or operand in host memory: a kernel reading pinned host memory reads
    it over PCIe, which the estimate times as host traffic)."""
    if ins.opcode.startswith(COUNTED_ELSEWHERE) or ins.opcode.endswith(_ASYNC) or "S(5)" in ins.type:
        return True
    return any("S(5)" in instrs[o].type for o in ins.operands if o in instrs)


def moved_bytes(ins: Instr, comps: dict[str, list[Instr]], instrs: dict[str, Instr]) -> int:
    """Bytes ``ins`` reads and writes: its result and operands, but for a fusion an operand its fused computation only
    slices or gathers from (the slices, or the gathered elements, are read: e.g. the label's logit taken from a chunk's
    logits) and the buffer a slice update writes in place (the update alone is written), bitcasts looked through (they
    move nothing)."""
    body = _fused(ins, comps)
    if body is None:
        return array_bytes(ins.type) + sum(array_bytes(instrs[o].type) for o in ins.operands if o in instrs)
    local = {i.name: i for i in body}
    users = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)

    def source(name: str) -> str:  # what a chain of bitcasts starts from
        while local[name].opcode == "bitcast":
            name = local[name].operands[0]
        return name

    def readers(name: str) -> list[Instr]:  # the users of a value, through bitcasts
        return [r for u in users[name] for r in (readers(u.name) if u.opcode == "bitcast" else [u])]

    root = body[-1]  # HLO text ends a computation with its ROOT
    in_place, total = set(), 0
    for out in (root.operands if root.opcode == "tuple" else (root.name,)):
        made = local[source(out)]
        if made.opcode == "dynamic-update-slice":  # written in place: the update alone
            in_place.add(source(made.operands[0]))
            total += array_bytes(local[made.operands[1]].type)
        else:
            total += array_bytes(local[out].type)
    for p in (i for i in body if i.opcode == "parameter" and i.name not in in_place):
        its = readers(p.name)  # sliced: only ever the array a slice or gather takes from (not its start or indices)
        sliced = its and all(u.opcode in ("slice", "dynamic-slice", "gather") and source(u.operands[0]) == p.name
                             for u in its)
        # a gather may take an element more than once (repeated indices): never more than the operand is read
        total += min(sum(array_bytes(u.type) for u in its), array_bytes(p.type)) if sliced else array_bytes(p.type)
    return total


def is_gemm(ins: Instr, comps: dict[str, list[Instr]]) -> bool:
    """A matmul kernel: a ``dot`` or ``convolution``, or a fusion around one (XLA's Triton GEMM fusions)."""
    body = [ins] if ins.opcode in ("dot", "convolution") else _fused(ins, comps) or []
    return any(i.opcode in ("dot", "convolution") for i in body)


def kernels(hlo_text: str, branch_shares: dict[int, tuple[float, ...]] | None = None):
    """``(instruction, runs per step, bytes it moves a run)`` of each kernel that is not a matmul, attention, another
    custom call, a collective or a host transfer: the elementwise work, reductions, copies, fills and slice updates
    (and the optimizer update's), runs counted by ``executed``."""
    comps, _ = parse(hlo_text)
    instrs = {i.name: i for body in comps.values() for i in body}  # instruction names are the module's, unique
    for ins, times in executed(hlo_text, branch_shares):
        if ins.opcode not in NO_KERNEL and not counted_elsewhere(ins, instrs) and not is_gemm(ins, comps):
            yield ins, times, moved_bytes(ins, comps, instrs)


def kernel_bytes(hlo_text: str, branch_shares: dict[int, tuple[float, ...]] | None = None) -> float:
    """Bytes per step that ``kernels`` read and write, all told."""
    return sum(times * moved for _, times, moved in kernels(hlo_text, branch_shares))
