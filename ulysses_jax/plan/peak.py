"""What is alive on the device where its memory peaks: XLA's live ranges read beside its buffer assignment.

``plan``'s other buffer list (``planner.largest_buffers``) names XLA's allocation slots, each the union of every value
that ever used it, so it shows what is large, not what is alive at once. To go longer, one needs the values alive at
the point where the heap is highest, and which op made each. XLA writes both when asked
(``xla_dump_buffer_assignment_analysis``, in ``kernel_report.dump_options``):

* ``...-live-range.txt``: the program's instructions in one flattened order (loop bodies and branches inlined) and,
  per value, the first and last position at which it is alive;
* ``...-buffer-assignment.txt``: per value, its size and offset inside its allocation;
* the optimised HLO: per instruction, the JAX op name it came from (``metadata={op_name=...}``).

``peak(dump_dir)`` sweeps the positions in order and counts each piece of device memory once (values sharing an
allocation and offset are one buffer: a loop's carry and its body's parameter, a branch's result and the
conditional's); the position of the largest sum is the peak. Host (pinned) memory, parameters and constants are left
out: they are the state, reported apart. The heap XLA lays out can exceed that sum where its packing leaves gaps;
``Peak.heap_bytes`` is the extent of the layout, for comparison.

Read on jax 0.10.2's XLA (2026-11-27): Qwen3.5-9B at 8,388,608 tokens on 8 compile-only H100s named the six input
gradients of the delta-net's projections as what filled the device (``experiments/results/plan_hybrid_h100.md``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)$", re.M)
_RANGE = re.compile(r"^\s+(\S+?\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_VALUE = re.compile(r"value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"", re.M)


@dataclasses.dataclass(frozen=True)
class Live:
    """One value alive at the peak: its bytes, its shape, and the JAX op that made it (``""`` where XLA made it)."""
    bytes: int
    shape: str
    op: str

    def where(self, width: int = 90) -> str:
        """The op name's last components, short enough for one line (``jit(step)/transpose(jvp())/...`` dropped)."""
        parts = [p for p in self.op.split("/") if p not in ("while", "body", "closed_call", "checkpoint")]
        text = "/".join(parts[-4:])
        return text if len(text) <= width else "..." + text[-width + 3:]


@dataclasses.dataclass(frozen=True)
class Peak:
    """The device's peak: ``live_bytes`` alive there (each buffer once), ``heap_bytes`` the extent of XLA's layout of
    its temporaries, ``position`` in the flattened instruction order of ``length``, the values alive, largest first."""
    live_bytes: int
    heap_bytes: int
    position: int
    length: int
    values: tuple[Live, ...]


def _one(dump_dir: pathlib.Path, pattern: str) -> str | None:
    found = sorted(dump_dir.glob(pattern))
    return found[-1].read_text() if found else None


def _device_values(assignment: str) -> dict[str, tuple[int, int, int, str]]:
    """``{value name: (allocation, offset, size, shape)}`` of the device temporaries (default memory space)."""
    values = {}
    for text in assignment.split("\nallocation ")[1:]:
        head = text.split("\n", 1)[0]
        index = int(head.split(":", 1)[0])
        if "parameter" in head or "constant" in head or re.search(r"color [1-9]", head):
            continue  # the state (parameters), constants, and host memory (a colour other than 0)
        for m in _VALUE.finditer(text):
            values[m.group(1) + (m.group(2) or "{}")] = (index, int(m.group(4)), int(m.group(3)), m.group(5))
    return values


def peak(dump_dir: str | pathlib.Path, n: int = 12) -> Peak | None:
    """The device's peak in the program XLA dumped to ``dump_dir`` (module doc), with its ``n`` largest live values;
    ``None`` without the three files (an XLA that writes no live ranges, or a dump without them)."""
    dump_dir = pathlib.Path(dump_dir)
    ranges_text = _one(dump_dir, "*after_optimizations-live-range.txt")
    assignment = _one(dump_dir, "*after_optimizations-buffer-assignment.txt")
    hlo = _one(dump_dir, "*gpu_after_optimizations.txt")
    if ranges_text is None or assignment is None or "BufferLiveRange:" not in ranges_text:
        return None
    order, ranges_part = ranges_text.split("BufferLiveRange:", 1)
    length = len(_SEQUENCE.findall(order))
    values = _device_values(assignment)
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(ranges_part)
              if m.group(1) in values}
    if not ranges:
        return None
    # sweep: a buffer (allocation, offset, size) counts once while any value in it is alive
    events: dict[int, list[tuple[tuple[int, int, int], int]]] = {}
    for name, (start, end) in ranges.items():
        key = values[name][:3]
        events.setdefault(start, []).append((key, 1))
        events.setdefault(end + 1, []).append((key, -1))
    users: dict[tuple[int, int, int], int] = {}
    total, best, at = 0, -1, 0
    for position in sorted(events):
        for key, step in events[position]:
            before = users.get(key, 0)
            users[key] = before + step
            if before == 0 and step > 0:
                total += key[2]
            elif before == 1 and step < 0:
                total -= key[2]
        if total > best:
            best, at = total, position
    ops = dict(_OP_NAME.findall(hlo or ""))
    seen, live = set(), []
    for name, (start, end) in ranges.items():
        key = values[name][:3]
        if start <= at <= end and key not in seen:
            seen.add(key)
            live.append(Live(key[2], values[name][3], ops.get(name.split("{")[0], "")))
    heap = max(offset + size for _, offset, size, _ in values.values())
    live.sort(key=lambda v: -v.bytes)
    return Peak(best, heap, at, length, tuple(live[:n]))
