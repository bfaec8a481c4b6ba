"""Loss curves in one plot: the same training run without and with --fp8 (float8 projections), one float8 run per
scaling recipe asked for.

    python experiments/fp8_curves.py --preset llama3.2-1b --steps 200 --seq-len 4096 --fp8-recipe both   # GPU (Hopper)
    python experiments/fp8_curves.py --preset tiny --steps 60 --seq-len 256 --allow-cpu    # CPU dry run
    python experiments/fp8_curves.py --data my_corpus/ --fp8-recipe delayed -- --mesh.sp 8   # after --: train flags

Runs `ulysses-jax train` for the baseline and then with --fp8 for each recipe (`--fp8-recipe both`: current, then
delayed), each in its own process and run directory under --work-dir, with the same seed, data (the built-in corpus
of the Python standard library's sources unless --data) and flags. Copies each run's metrics.jsonl into --out-dir as
it ends, then writes ``fp8_curves_<preset>_<device>_<date>``: a .png (the curves, raw and smoothed over --smooth
steps, and each float8 / baseline ratio of the smoothed curves beneath), a .csv (the losses per step) and a .md (date,
device, command, commit, the final smoothed losses and their ratios, the median step times). The baseline computes in
the preset's dtype (bf16 for the published presets; the tiny preset computes in float32). On CPU devices the step
times say nothing about a GPU: the .md says which device ran it.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

from results_io import git_head  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--data", nargs="*", default=[], help="training text (default: the built-in corpus)")
    p.add_argument("--fp8-recipe", default="current", choices=("current", "delayed", "both"),
                   help="the float8 run's scaling; both: a run of each beside the one baseline")
    p.add_argument("--smooth", type=int, default=10, help="steps in the moving average of the smoothed curves")
    p.add_argument("--work-dir", type=pathlib.Path, default=None, help="the runs' directories (default: a temp dir)")
    p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    p.add_argument("--allow-cpu", action="store_true", help="run on fake CPU devices (a dry run)")
    p.add_argument("train_flags", nargs="*", help="after --: more `ulysses-jax train` flags, given to every run")
    return p.parse_args(argv)


def runs_of(args) -> dict[str, list[str]]:
    """``{run name: its own train flags}``: the baseline, then a float8 run per recipe asked for."""
    recipes = ("current", "delayed") if args.fp8_recipe == "both" else (args.fp8_recipe,)
    return {"baseline": [], **{f"--fp8 ({r})": ["--fp8", "--fp8-recipe", r] for r in recipes}}


def folder(name: str) -> str:
    """A run's directory (and metrics file) name: ``baseline``, ``fp8_current``, ``fp8_delayed``."""
    return name.replace("--fp8 (", "fp8_").rstrip(")")


def train(args, name: str, run_dir: pathlib.Path) -> dict:
    """Run one `ulysses-jax train`; ``{"losses": {step: loss}, "step_s": [...], "device": str}``."""
    cmd = [sys.executable, "-m", "ulysses_jax", "train", "--preset", args.preset, "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--run-dir", str(run_dir), "--no-progress", "--checkpoint-every",
           str(args.steps), *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
           *(["--data", *args.data] if args.data else []),
           "--memory", "manual",  # every run with the same memory tools, not each the fastest of its own search
           *args.train_flags, *runs_of(args)[name]]
    print("$", " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"fp8_curves: the {name} run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    # the run's metrics into the results at once (a limit that stops the second run keeps the first's curve); its
    # last checkpoint (15 GB for llama3.2-1b with its optimizer) removed when the runs live in a temporary folder
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / "metrics.jsonl", args.out_dir / f"fp8_curves_{args.preset}_{run_dir.name}.metrics.jsonl")
    if args.work_dir is None:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((run_dir / "run.json").read_text())
    return {"losses": {r["step"]: r["loss"] for r in records}, "step_s": [r["step_time_s"] for r in records[1:]],
            "device": record["starts"][0]["device"], "dtype": record["compute"]["compute_dtype"]}


def smoothed(values: list[float], k: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def plot(path: pathlib.Path, steps, curves: dict, k: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 1))
    colors = ("tab:blue", "tab:orange", "tab:green")
    for (name, losses), color in zip(curves.items(), colors):
        top.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
        top.plot(steps, smoothed(losses, k), color=color, label=f"{name} ({k}-step mean)")
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=9)
    top.legend()
    base = smoothed(curves["baseline"], k)
    for (name, losses), color in list(zip(curves.items(), colors))[1:]:
        bottom.plot(steps, [b / a for a, b in zip(base, smoothed(losses, k))], color=color, label=name)
    bottom.axhline(1.0, color="gray", linewidth=0.8)
    bottom.set_ylabel("fp8 / baseline")
    bottom.legend(fontsize=8)
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="fp8-curves-"))
    runs = {name: train(args, name, work / folder(name)) for name in runs_of(args)}
    device = runs["baseline"]["device"]
    if device == "cpu" and not args.allow_cpu:
        print("fp8_curves: the runs went to CPU devices (no GPU); pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    steps = sorted(runs["baseline"]["losses"])
    curves = {name: [r["losses"][s] for s in steps] for name, r in runs.items()}
    k = min(args.smooth, len(steps))
    finals = {name: smoothed(v, k)[-1] for name, v in curves.items()}
    ratios = {name: finals[name] / finals["baseline"] for name in curves if name != "baseline"}
    stamp = datetime.datetime.now(datetime.timezone.utc)
    stem = args.out_dir / f"fp8_curves_{args.preset}_{device.lower().replace(' ', '-')}_{stamp:%Y%m%d-%H%M%S}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    title = (f"{args.preset}, {args.steps} steps of {args.seq_len} tokens on {device}"
             f"{' (CPU: a dry run, not a GPU result)' if device == 'cpu' else ''}")
    plot(stem.with_suffix(".png"), steps, curves, k, title)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *curves])
        writer.writerows([s, *(v[i] for v in curves.values())] for i, s in enumerate(steps))
    meta = {"date": f"{stamp:%Y-%m-%d %H:%M UTC}", "device": device,
            "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]), "commit": git_head(),
            "train flags of every run": " ".join(args.train_flags) or "(none)",
            "baseline computes in": runs["baseline"]["dtype"],
            "data": " ".join(args.data) or "the built-in corpus (the Python standard library's sources)"}
    lines = [f"# Loss with and without --fp8: {title}", ""] + [f"- {k_}: `{v}`" for k_, v in meta.items()] + [""]
    lines += ["| run | final loss (" + f"{k}-step mean) | median step s |", "|---|---|---|"]
    lines += [f"| {name} | {finals[name]:.4f} | {statistics.median(runs[name]['step_s'] or [0]):.3f} |"
              for name in curves]
    lines += [""] + [f"{name} / baseline at the end: {r:.4f} ({100 * (r - 1):+.2f}%)." for name, r in ratios.items()]
    lines += ["", f"![curves]({stem.with_suffix('.png').name})", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"final losses {finals}, ratios {ratios}; wrote {stem}.png/.csv/.md", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.pop("XLA_FLAGS", None)  # train picks its own fake CPU devices where there is no accelerator
    sys.exit(main())
