"""The GPU kernels of a compiled program: launch figures from XLA's dump, registers and spills from ptxas.

Compile with ``dump_options(dir)`` (``lowered.compile(compiler_options=dump_options(dir))``): XLA writes the
optimised HLO, the thunk sequence (each kernel launch with its grid, threads and dynamic shared memory) and one
``.ptx`` file per generated kernel, Pallas kernels included (they are Triton custom calls that XLA compiles
itself). ``kernels(dir)`` reads them and runs ``ptxas -v -arch=sm_90a`` on each PTX file, which reports the
registers per thread and the bytes spilled to local memory. ptxas comes with the ``nvidia-cuda-nvcc`` wheel that
the CUDA plugin installs; without it the register figures are ``None``. The instruction mix comes from the kernel's
own PTX (``instruction_mix``): Hopper warpgroup MMAs (``wgmma.mma_async``), Ampere-style ``mma.sync``, Tensor Memory
Accelerator copies (``cp.async.bulk``) and Ampere async copies (``cp.async``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import shutil
import subprocess
import sys

from ulysses_jax.kernels.flash_estimate import resident_blocks

_LAUNCH = re.compile(
    r"\bkCustomKernel\b.*?\]\s+(?P<name>\S+)\s+grid: \[(?P<grid>[\d, ]+)\]\s+threads: \[(?P<threads>[\d, ]+)\]"
    r"\s+shared_memory: (?P<smem>\d+) bytes"
)
_ENTRY = re.compile(r"\.visible \.entry (\w+)\(")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_MIX = {  # instruction-mix field -> PTX pattern
    "wgmma": re.compile(r"\bwgmma\.mma_async\b"),
    "mma_sync": re.compile(r"\bmma\.sync\b"),
    "tma": re.compile(r"\bcp\.async\.bulk\b"),
    "cp_async": re.compile(r"\bcp\.async\.(?:ca|cg)\b"),
}
_WGMMA_SHAPE = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)")


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    name: str
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    shared_memory_bytes: int  # dynamic shared memory per block, as launched
    registers: int | None = None  # per thread, from ptxas
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    wgmma: int | None = None  # instruction counts in the kernel's PTX (static, not executed counts)
    mma_sync: int | None = None
    tma: int | None = None
    cp_async: int | None = None
    wgmma_shapes: tuple[str, ...] = ()  # distinct wgmma shapes, e.g. ("m64n64k16",)

    @property
    def warps(self) -> int:
        return self.threads[0] * self.threads[1] * self.threads[2] // 32

    @property
    def resident_blocks(self) -> int | None:
        """Thread blocks of this kernel resident per SM (occupancy), once ptxas has reported its registers."""
        if self.registers is None:
            return None
        return resident_blocks(registers=self.registers, threads=self.threads[0] * self.threads[1] * self.threads[2],
                               shared_memory_bytes=self.shared_memory_bytes)


def dump_options(dump_dir: str | pathlib.Path) -> dict[str, object]:
    """XLA compiler options that dump the optimised HLO, the thunk sequence, the kernels' PTX and the buffers' live
    ranges (``plan/peak.py``) to ``dump_dir``."""
    return {"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True, "xla_dump_buffer_assignment_analysis": True}


@functools.lru_cache(maxsize=1)
def ptxas_path() -> str | None:
    """``ptxas`` of the ``nvidia-cuda-nvcc`` wheel next to this Python, else one on ``PATH``."""
    for site in map(pathlib.Path, sys.path):
        for sub in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas"):
            if (site / sub).is_file():
                return str(site / sub)
    return shutil.which("ptxas")


def ptxas_figures(ptx_file: str | pathlib.Path, arch: str = "sm_90a") -> dict[str, dict[str, int]]:
    """``{entry: {"registers", "spill_store_bytes", "spill_load_bytes"}}`` from ``ptxas -v`` on one PTX file."""
    exe = ptxas_path()
    if exe is None:
        return {}
    out = subprocess.run([exe, "-v", f"-arch={arch}", str(ptx_file), "-o", "/dev/null"],
                         capture_output=True, text=True, check=False)
    figures, current = {}, None
    for line in (out.stdout + out.stderr).splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            current = figures.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        if (m := _SPILLS.search(line)) is not None:
            current["spill_store_bytes"], current["spill_load_bytes"] = int(m.group(1)), int(m.group(2))
        if (m := _REGS.search(line)) is not None:
            current["registers"] = int(m.group(1))
    return figures


def _entry_bodies(ptx: str) -> dict[str, str]:
    """``{entry name: its PTX text}``: each ``.entry`` up to the next one (one kernel per file in XLA's dump)."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    return {name: ptx[a:b] for (a, name), (b, _) in zip(starts, starts[1:] + [(len(ptx), "")])}


def instruction_mix(ptx_body: str) -> dict[str, object]:
    """Static counts of the tensor-core and copy instructions in one kernel's PTX (``KernelInfo`` fields)."""
    mix: dict[str, object] = {name: len(p.findall(ptx_body)) for name, p in _MIX.items()}
    mix["wgmma_shapes"] = tuple(sorted(set(_WGMMA_SHAPE.findall(ptx_body))))
    return mix


def kernels(dump_dir: str | pathlib.Path, *, prefix: str | tuple[str, ...] = "", run_ptxas: bool = True
            ) -> list[KernelInfo]:
    """Kernels launched by the program dumped in ``dump_dir`` whose name starts with ``prefix`` (or one of them), one
    per name.

    Launch figures come from the (last) thunk-sequence file; registers and spills from ptxas on the PTX file
    that defines the kernel.
    """
    dump_dir = pathlib.Path(dump_dir)
    seqs = sorted(dump_dir.glob("*thunk_sequence.txt"))
    launches: dict[str, KernelInfo] = {}
    for seq in seqs[-1:]:
        for m in _LAUNCH.finditer(seq.read_text()):
            name = m.group("name")
            if name.startswith(prefix) and name not in launches:
                launches[name] = KernelInfo(
                    name=name,
                    grid=tuple(int(x) for x in m.group("grid").split(",")),
                    threads=tuple(int(x) for x in m.group("threads").split(",")),
                    shared_memory_bytes=int(m.group("smem")),
                )
    if launches:
        for ptx in sorted(dump_dir.glob("*.ptx")):
            bodies = {n: b for n, b in _entry_bodies(ptx.read_text()).items() if n in launches}
            if not bodies:
                continue
            figures = ptxas_figures(ptx) if run_ptxas else {}
            for name, body in bodies.items():
                launches[name] = dataclasses.replace(launches[name], **instruction_mix(body), **figures.get(name, {}))
    return sorted(launches.values(), key=lambda k: k.name)
