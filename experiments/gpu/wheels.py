"""Download the wheels the lent GPU machine lacks, for ``experiments/gpu/first_contact.sh`` (``make gpu-wheels``).

That machine reaches no package registry; its image (``image_packages.txt`` beside this file) has jax with the CUDA
plugin, flax, optax, orbax and most of what the project needs, but not all. This resolves the project's runtime
dependencies (``pyproject.toml``) plus pytest for Python 3.12 on manylinux x86-64, binary wheels only, keeps the
packages the image does not list, and downloads exactly those into ``.whl/`` (ignored by git; carried to the device).

    python experiments/gpu/wheels.py            # resolve, download, check nothing is missing
    python experiments/gpu/wheels.py --dry-run  # print the resolved set and what would be downloaded

Exit 1, with one line naming the packages, when the resolved set holds a package that is neither in the image nor
downloaded.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64"]
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
          *[a for p in PLATFORMS for a in ("--platform", p)]]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (HERE / "image_packages.txt").read_text().splitlines()
    return {canonical(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


# the peers the benchmarks time beside ours, over the image's torch and triton (downloaded without their dependencies:
# the image has torch, triton, transformers and einops): Liger Kernel (bench_peers.py) and flash-linear-attention's
# gated delta rule (bench_delta.py)
PEER_WHEELS = ["liger-kernel==0.8.5", "flash-linear-attention==0.6.0", "fla-core==0.6.0"]


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], "pytest>=8"]


def resolve(reqs: list[str]) -> dict[str, str]:
    """``{name: version}`` of the whole dependency closure for the target, by pip's own resolver (no install)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
               str(report), "--target", str(pathlib.Path(tmp) / "t"), *TARGET, *reqs]
        subprocess.run(cmd, check=True)
        found = json.loads(report.read_text())["install"]
    return {canonical(x["metadata"]["name"]): x["metadata"]["version"] for x in found}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=pathlib.Path, default=ROOT / ".whl")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    closure = resolve(requirements())
    image = image_packages()
    missing = {n: v for n, v in sorted(closure.items()) if n not in image}
    print(f"resolved {len(closure)} packages for Python 3.12 manylinux x86-64; {len(closure) - len(missing)} in the "
          f"image; to carry: " + ", ".join(f"{n}=={v}" for n, v in missing.items()))
    if args.dry_run:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(args.dest), *TARGET,
                    *(f"{n}=={v}" for n, v in missing.items())], check=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(args.dest), *TARGET[:1],
                    "--python-version", "3.12", *PEER_WHEELS], check=True)  # pure-Python wheels
    missing.update({canonical(r.split("==")[0]): r.split("==")[1] for r in PEER_WHEELS})
    got = {canonical(w.name.split("-")[0]) for w in args.dest.glob("*.whl")}
    absent = sorted(set(missing) - got)
    if absent:
        print(f"wheels.py: no wheel downloaded for {', '.join(absent)}; the device run would miss them", file=sys.stderr)
        return 1
    size = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(f"{len(got)} wheels in {args.dest.relative_to(ROOT) if args.dest.is_relative_to(ROOT) else args.dest} "
          f"({size / 2**20:.1f} MiB); nothing missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
