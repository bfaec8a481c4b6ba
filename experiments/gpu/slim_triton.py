"""Triton 3.7.1, cut down to fit a device call, for flash-linear-attention's backward on the lent H200 (issue 39).

fla 0.6.0 refuses its backward on Hopper GPUs under Triton 3.4 to 3.7.0 (they compute the gated delta rule's
``chunk_bwd_dqkwg`` wrongly, its issue 640); the lent image has Triton 3.6.0, and Triton 3.7.1's wheel is 189 MiB,
beyond the 64 MiB a call may carry. Most of it is debug information and tools the benchmark does not use: this
unpacks the wheel, leaves out the Blackwell ``ptxas``, ``cuobjdump``, ``nvdisasm``, CUPTI's libraries (its headers
stay), the Proton profiler, the instrumentation and FileCheck tools, strips the shared libraries' debug information
(``libtriton.so``: 461 MB -> 180 MB), and writes ``.triton/triton-<version>-slim.tar.xz`` (43.0 MiB). Kept: the
Python package, ``libtriton.so``, the NVIDIA backend with its ``ptxas`` (sm_90a), libdevice, the AMD backend (the
dist-info's entry points name it: Triton fails to import without it), and the dist-info (the version reads 3.7.1).
Checked here with Python 3.12 and no GPU: it imports and compiles a kernel for sm_90 down to its cubin, a ``tl.dot``
as wgmma.

    python experiments/gpu/slim_triton.py            # .triton/triton-3.7.1-slim.tar.xz; carry .triton to call C

On the device (``experiments/gpu/first_contact.sh``): unpacked into its own folder, which ``bench_delta.py
--fla-site`` puts first on the path of flash-linear-attention's process alone; JAX and our step never see it.
Needs ``strip`` (binutils) and ``xz`` here; the download goes through pip like ``wheels.py``'s.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from wheels import ROOT, TARGET  # noqa: E402

VERSION = "3.7.1"
# what fla's kernels do not use on an H100 or H200: paths inside the wheel
DROP = ["triton/backends/nvidia/bin/ptxas-blackwell", "triton/backends/nvidia/bin/cuobjdump",
        "triton/backends/nvidia/bin/nvdisasm", "triton/backends/nvidia/lib/cupti", "triton/_C/libproton.so",
        "triton/profiler", "triton/instrumentation", "triton/FileCheck"]


def slim(wheel: pathlib.Path, out: pathlib.Path) -> int:
    """Unpack ``wheel``, leave out ``DROP``, strip the shared libraries, write ``out`` (tar.xz); its size in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        for rel in DROP:
            path = site / rel
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            else:
                print(f"slim_triton.py: {rel} is not in {wheel.name} (another layout?); left as it is", file=sys.stderr)
        for lib in (p for p in site.rglob("*.so*") if p.is_file()):
            subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
        for exe in (site / "triton/backends/nvidia/bin").glob("*"):
            exe.chmod(0o755)  # zipfile drops the executable bit
        part = out.with_name(out.name + ".part")  # renamed when whole: a failed run leaves no archive to carry
        subprocess.run(["tar", "-C", str(site), "-cf", str(part), "--use-compress-program=xz -9 -T0", "."], check=True)
        part.replace(out)
    return out.stat().st_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=pathlib.Path, default=ROOT / ".triton")
    p.add_argument("--version", default=VERSION)
    args = p.parse_args(argv)
    for tool in ("strip", "xz", "tar"):
        if shutil.which(tool) is None:
            print(f"slim_triton.py: `{tool}` is not on PATH; install it (binutils, xz-utils) and run again",
                  file=sys.stderr)
            return 2
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, *TARGET,
                        f"triton=={args.version}"], check=True)
        wheel = next(pathlib.Path(tmp).glob("triton-*.whl"))
        out = args.dest / f"triton-{args.version}-slim.tar.xz"
        size = slim(wheel, out)
        print(f"{out}: {size / 2**20:.1f} MiB (the wheel: {wheel.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
