"""Collectives of a compiled program, read from its optimised HLO text (``compiled.as_text()``).

``collectives(hlo_text)`` lists every collective the program runs per step: all-gather, all-reduce,
reduce-scatter, all-to-all, collective-permute (synchronous or as ``*-start`` / ``*-done`` pairs, or wrapped in
``async-start``). Operations inside a loop body (the layer scan, gradient accumulation) count once per trip: a
``while`` whose trip count XLA knows multiplies everything it calls. A ``conditional`` runs one of its branches: each
branch counts for its share of the runs, given by the caller where it knows them (``branch_shares``: the planner's
layer kinds, e.g. a hybrid's 8 attention and 24 delta-net layers), else each branch equally often. Bytes are per
device: the larger of what an operation takes and what it gives (an all-gather's gathered output, a reduce-scatter's
full input), the buffer that crosses the links at most.

Each collective is also placed relative to the hosts, from its replica groups (or source-target pairs) and the
number of devices per host: ``intra_host`` when every group stays within one host (NVLink), else ``inter_host``;
an all-to-all whose groups span hosts is split, since each device sends ``1/g`` of its buffer to each member of
its group of ``g``: the parts bound for other hosts count as ``inter_host``, the rest (its own part included) as
``intra_host``.
For asynchronous pairs, ``overlapped`` counts the pairs with compute (a fusion, a custom call, a matmul)
scheduled between ``start`` and ``done``: a collective that can hide behind work.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
# a called computation, or a {list} of them (every branch of a conditional: once only the first was read)
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|async_execution_thread|branch_computations)="
                    r"(\{[^}]*\}|%[\w.\-]+)")
_COMPUTE = ("fusion", "custom-call", "dot", "convolution")


@dataclasses.dataclass
class Collective:
    kind: str
    count: int = 0  # executions per step (loop trips included)
    bytes: int = 0  # per device, summed over executions
    intra_host_bytes: int = 0
    inter_host_bytes: int = 0
    async_pairs: int = 0  # start/done pairs (per execution)
    overlapped: int = 0  # pairs with compute scheduled between start and done
    overlapped_bytes: int = 0  # the bytes of those pairs

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


Instr = _Instr  # an instruction of the parsed text (``parse``), for the modules that read programs


def _split_type(rest: str) -> tuple[str, str]:
    """``"(f32[2], s32[]) op(...)..."`` -> (type text, remainder starting at the opcode)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's leaves summed; layouts ignored)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def parse(hlo_text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """``({computation: [instructions in schedule order]}, entry name)``."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (m := _HEADER.match(line)) is not None:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None or (m := _INSTR.match(line)) is None:
            continue
        type_text, rest = _split_type(m.group(2))
        opcode, _, args = rest.partition("(")
        depth, i = 1, 0
        while i < len(args) and depth:
            depth += args[i] == "("
            depth -= args[i] == ")"
            i += 1
        operands = tuple(re.findall(r"%([\w.\-]+)", args[: i - 1]))
        comps[current].append(_Instr(m.group(1), type_text, opcode.strip(), operands, args[i:]))
    return comps, entry


FLOAT8 = ("f8e4m3fn", "f8e5m2")


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


CUBLAS_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")  # XLA's GEMMs as library calls


def gemm_contracting(ins: _Instr) -> list[int] | None:
    """The lhs contracting dimensions of a matmul: a ``dot``, or a cuBLAS GEMM custom call (XLA's GEMMs when Triton's
    are off, ``--xla_gpu_enable_triton_gemm=false``; their dimension numbers in the backend config); None for any
    other instruction."""
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        return [int(d) for d in m.group(1).split(",") if d] if m else []
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs) if ins.opcode == "custom-call" else None
    if target is None or target.group(1) not in CUBLAS_GEMMS:
        return None
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    return [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []


def gemm_flops(ins: _Instr, types: dict[str, str]) -> float | None:
    """``2 x output elements x contracted size`` of a matmul (``gemm_contracting``), its lhs's type read from
    ``types`` (its computation's); None for any other instruction."""
    contracting = gemm_contracting(ins)
    if contracting is None or not ins.operands:
        return None
    lhs = _dims(types.get(ins.operands[0], ""))
    return 2.0 * math.prod(_dims(ins.type)) * math.prod(lhs[i] for i in contracting if i < len(lhs))


def float8_dots(hlo_text: str) -> dict[str, dict[str, int]]:
    """The dots whose two operands are float8, by operand types (``"f8e4m3fn x f8e4m3fn"``: ``--fp8``'s forward
    GEMMs; with ``f8e5m2``, the output gradient: its backward's): ``{"dots": count, "flops": FLOPs}``, each dot
    counted once where it appears in the program text (a loop body's once, not per trip; XLA may have merged dots that
    share an operand, such as q, k and v's; cuBLASLt's float8 GEMMs count as dots). An operand's type is read from its
    computation."""
    comps, _ = parse(hlo_text)
    out: dict[str, dict[str, int]] = {}
    for instrs in comps.values():
        types = {i.name: i.type for i in instrs}
        for ins in instrs:
            kinds = [types.get(o, "").partition("[")[0] for o in ins.operands[:2]]
            if len(kinds) < 2 or not all(k in FLOAT8 for k in kinds) or (f := gemm_flops(ins, types)) is None:
                continue
            row = out.setdefault(" x ".join(kinds), {"dots": 0, "flops": 0})
            row["dots"] += 1
            row["flops"] += int(f)
    return out


_LAYOUT_ONLY = {"parameter", "transpose", "copy", "bitcast"}


def parameter_copies(hlo_text: str) -> list[tuple[str, int]]:
    """``[(parameter, bytes)]``: the program's arguments it copies whole into another layout before using them (an
    entry fusion of one parameter that only transposes or copies it), largest first. XLA does this where every use of
    a stacked weight in the layer loop wants another layout (Hopper's float8 GEMMs: the contracted dimension
    contiguous in both operands); the copy lives as long as the loop."""
    comps, entry = parse(hlo_text)
    instrs = comps.get(entry, [])
    params = {i.name: i for i in instrs if i.opcode == "parameter"}
    found = []
    for ins in instrs:
        called = re.search(r"\bcalls=%([\w.\-]+)", ins.attrs)
        if ins.opcode != "fusion" or len(ins.operands) != 1 or ins.operands[0] not in params or called is None:
            continue
        body = comps.get(called.group(1), [])
        if body and {i.opcode for i in body} <= _LAYOUT_ONLY and any(i.opcode != "parameter" for i in body):
            name = re.sub(r"^state_+params_+|_+value(\.\d+)?$", "", ins.operands[0])
            found.append((re.sub(r"_{3,}", ".", name), array_bytes(ins.type)))
    return sorted(found, key=lambda x: -x[1])


def parameter_copies_note(hlo_text: str) -> str | None:
    """One line on ``parameter_copies``, or None when there are none."""
    copies = parameter_copies(hlo_text)
    if not copies:
        return None
    names = ", ".join(n for n, _ in copies[:4]) + (f" and {len(copies) - 4} more" if len(copies) > 4 else "")
    return (f"XLA copies {len(copies)} parameters whole into another layout each step, "
            f"{sum(b for _, b in copies) / 2**30:.2f} GiB held while the layer loop runs ({names}): every use of each "
            f"wants another layout than the one it rests in (with --fp8: Hopper's float8 GEMMs read both operands "
            f"with the contracted dimension contiguous)")


def float8_note(hlo_text: str) -> str:
    """One line on the float8 dots of a ``--fp8`` program (``float8_dots``)."""
    dots = float8_dots(hlo_text)
    fwd = dots.get("f8e4m3fn x f8e4m3fn", {}).get("dots", 0)
    bwd = sum(v["dots"] for k, v in dots.items() if "f8e5m2" in k)
    return (f"--fp8: {fwd} float8 forward dots (e4m3 x e4m3) and {bwd} backward ones (e5m2 gradients) in the "
            f"compiled program's text (a loop body counted once; XLA merges dots that share an operand, as q, k, v)")


def _trip_count(instr: _Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    return int(m.group(1)) if m else None


def multiplicities(comps: dict[str, list[_Instr]], entry: str,
                   branch_shares: dict[int, tuple[float, ...]] | None = None) -> dict[str, float]:
    """How many times each computation runs per execution of ``entry``: while bodies (and conditions) times their trip
    count, a conditional's branch ``i`` of ``n`` its ``branch_shares[n][i]`` share of the conditional's runs (each
    ``1 / n`` when ``branch_shares`` has no entry for ``n``; module doc). Floats: a share of runs need not be whole."""
    mult: dict[str, float] = defaultdict(float)
    mult[entry] = 1
    # computations form a DAG; visit callers before callees by repeated relaxation (the graphs are small)
    edges: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, instrs in comps.items():
        for ins in instrs:
            factor = (_trip_count(ins) or 1) if ins.opcode == "while" else 1
            for key, group in _CALLS.findall(ins.attrs):
                callees = re.findall(r"%([\w.\-]+)", group)
                if key == "branch_computations":
                    shares = (branch_shares or {}).get(len(callees)) or (1 / len(callees),) * len(callees)
                    edges[name] += [(c, s) for c, s in zip(callees, shares)]
                else:
                    edges[name] += [(c, factor) for c in callees]
    indeg: dict[str, int] = defaultdict(int)
    for name in comps:
        for callee, _ in edges[name]:
            indeg[callee] += 1
    queue = [c for c in comps if indeg[c] == 0]
    order = []
    while queue:
        c = queue.pop()
        order.append(c)
        for callee, _ in edges[c]:
            indeg[callee] -= 1
            if indeg[callee] == 0:
                queue.append(callee)
    for c in order:
        for callee, factor in edges[c]:
            if callee in comps:
                mult[callee] += mult[c] * factor
    return dict(mult)


def executed(hlo_text: str, branch_shares: dict[int, tuple[float, ...]] | None = None) -> list[tuple[_Instr, float]]:
    """Each instruction of the computations that run as programs (the entry, loop bodies and conditions, branches; not
    fusion bodies or reducers, which are part of the kernel that calls them), with how many times it runs per
    execution (``multiplicities``): what counts kernels, or the runs of one."""
    comps, entry = parse(hlo_text)
    mult = multiplicities(comps, entry, branch_shares)
    inlined = {c for instrs in comps.values() for ins in instrs if ins.opcode not in ("while", "conditional", "call")
               for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", ins.attrs)}
    return [(ins, mult[name]) for name, instrs in comps.items() if name not in inlined and mult.get(name)
            for ins in instrs]


def _groups(attrs: str) -> list[list[int]] | None:
    if (m := re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)) is not None:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)", m.group(1) + "}")]
    if (m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)) is not None:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    if (m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)) is not None:
        # mesh-axes form: mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: groups vary along the listed axes
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        along = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(2))]
        rest = [i for i in range(len(names)) if i not in along]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + along)
        return ids.reshape(-1, math.prod(sizes[i] for i in along)).tolist()
    if (m := re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", attrs)) is not None:
        return [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def _crosses_hosts(attrs: str, devices_per_host: int | None, num_devices: int | None) -> bool:
    if not devices_per_host:
        return False
    groups = _groups(attrs)
    if not groups:  # no replica groups: every device in one group
        return bool(num_devices) and num_devices > devices_per_host
    return any(len({d // devices_per_host for d in grp}) > 1 for grp in groups)


def _off_host_fraction(attrs: str, devices_per_host: int | None, num_devices: int | None) -> float:
    """For an all-to-all: the mean share of a device's buffer addressed to group members on other hosts."""
    groups = _groups(attrs) or ([list(range(num_devices))] if num_devices else None)
    if not devices_per_host or not groups:
        return 0.0
    shares = [sum(d // devices_per_host != me // devices_per_host for d in grp) / len(grp)
              for grp in groups for me in grp]
    return sum(shares) / len(shares)


def collectives(
    hlo_text: str, *, devices_per_host: int | None = None, num_devices: int | None = None,
    branch_shares: dict[int, tuple[float, ...]] | None = None,
) -> dict[str, Collective]:
    """``{kind: Collective}`` per step of the program (see the module doc); kinds absent from it are left out.
    ``branch_shares``: how often each branch of a conditional runs (``multiplicities``)."""
    comps, entry = parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text() of a compiled program")
    mult = multiplicities(comps, entry, branch_shares)
    out: dict[str, Collective] = {}
    for name, instrs in comps.items():
        n = mult.get(name, 0)
        if not n:
            continue
        types = {ins.name: ins.type for ins in instrs}
        position = {ins.name: i for i, ins in enumerate(instrs)}
        for ins in instrs:
            op = ins.opcode
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            operands = ins.operands[:1] if kind == "ragged-all-to-all" else ins.operands  # (data, output buffer,
            # offsets and sizes): only the data is sent
            in_bytes = sum(array_bytes(types.get(o, "")) for o in operands)
            out_bytes = array_bytes(ins.type)
            if op.endswith("-start"):  # the result tuple holds the operands, the outputs and small contexts
                out_bytes = max(out_bytes - in_bytes, 0)
            size = max(in_bytes, out_bytes)
            c = out.setdefault(kind, Collective(kind))
            c.count += n
            c.bytes += n * size
            if kind == "all-to-all":
                off = round(n * size * _off_host_fraction(ins.attrs, devices_per_host, num_devices))
                c.inter_host_bytes += off
                c.intra_host_bytes += n * size - off
            elif _crosses_hosts(ins.attrs, devices_per_host, num_devices):
                c.inter_host_bytes += n * size
            else:
                c.intra_host_bytes += n * size
            if op.endswith("-start"):
                c.async_pairs += n
                done = next((j for j, d in enumerate(instrs) if d.opcode == kind + "-done" and ins.name in d.operands),
                            None)
                between = instrs[position[ins.name] + 1 : done] if done is not None else []
                if any(d.opcode in _COMPUTE for d in between):
                    c.overlapped += n
                    c.overlapped_bytes += n * size
    for c in out.values():  # shares of a conditional's runs are fractions: whole operations and bytes per step
        for f in ("count", "bytes", "intra_host_bytes", "inter_host_bytes", "async_pairs", "overlapped",
                  "overlapped_bytes"):
            setattr(c, f, int(round(getattr(c, f))))
    return out


def total_bytes(colls: dict[str, Collective]) -> int:
    return sum(c.bytes for c in colls.values())


_METADATA = re.compile(r",?\s*metadata=\{[^{}]*\}|fingerprint_before_lhs=\"\w*\",?")
_SOURCE_TABLES = re.compile(r"^FileNames\n.*?(?=^(?:%|ENTRY ))", re.M | re.S)


def fingerprint(hlo_text: str) -> str:
    """A hash of the optimised HLO without where its ops come from: the source tables (file names, functions,
    stack frames), each op's ``metadata={...}`` and the fingerprint of the unoptimised module that includes them.
    Those name the files of the installed package, not what runs: the hash is equal for the same program compiled
    from the same flags by ``plan`` and by ``train``."""
    import hashlib

    return hashlib.sha256(_METADATA.sub("", _SOURCE_TABLES.sub("", hlo_text)).encode()).hexdigest()[:16]
