"""`plan`'s estimate beside the steps this project has measured: one row per distinct configuration of a
`bench_peers.py` CSV, the estimate's parts, the measured step, and their ratio; `--fit` refits the calibration.

    python experiments/plan_vs_measured.py experiments/results/peers_h100_20261127.csv
    python experiments/plan_vs_measured.py experiments/results/peers_h100_20261127.csv --fit

Each configuration is compiled for one compile-only GPU of the row's kind (minutes on a CPU, no GPU). The target of
issue 38: every estimate within 10% of its measured step. `--fit` solves, by non-negative least squares on the
relative error, for the multipliers of four of the estimate's parts that would make it match: the attention of
head_dim-64 models, the bf16 matmuls, the float8 matmuls and the other kernels (elementwise work, copies, the optimizer
update: the compiled program's bytes; the rest kept as estimated, hd128 attention at its measured kernel rate).
Multipliers near 1 say the constants of `ulysses_jax/plan/estimate.py` (HEAD_DIM_FACTOR, MATMUL_EFFICIENCY,
FP8_MATMUL_RATE, KERNEL_BANDWIDTH_SHARE) are calibrated on these rows; it
also refits with each row left out and predicts that row, the honest error of a calibration fitted on few rows.
Results: a markdown table (and the fit) in --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=pathlib.Path, help="a bench_peers.py CSV (ours_step_s measured)")
    p.add_argument("--fit", action="store_true", help="refit the calibration's multipliers (and leave-one-out)")
    p.add_argument("--out-dir", type=pathlib.Path, default=HERE / "results")
    return p.parse_args(argv)


def configurations(path: pathlib.Path) -> list[dict]:
    """The CSV's distinct configurations of ours with a measured step (the peer columns dropped)."""
    seen, out = set(), []
    for r in csv.DictReader(open(path)):
        key = (r["model"], r["mode"], r["seq_len"], r["flags"], r["gpu"])
        if key in seen or not r["ours_step_s"]:
            continue
        seen.add(key)
        out.append({**r, "measured": float(r["ours_step_s"])})
    return out


def features(rows: list[dict]):
    """Per row: (hd64 attention s, bf16 matmul s, float8 matmul s, the other kernels' s, the rest as estimated s) from
    the plan's parts (the other kernels: elementwise work, copies and the optimizer update, timed by their bytes)."""
    out = []
    for r in rows:
        parts, hd64 = r["parts"], r["head_dim"] == 64
        fp8 = parts.get("matmul_fp8_s", 0.0)
        kernels = parts["elementwise_s"] + parts["update_s"]
        rest = (parts["compute_s"] - parts["attention_s"] - parts["matmul_s"] - kernels
                + (0.0 if hd64 else parts["attention_s"]))
        out.append((parts["attention_s"] if hd64 else 0.0, parts["matmul_s"] - fp8, fp8, kernels, rest))
    return out


def fit(rows: list[dict]) -> list[str]:
    import numpy as np
    from scipy.optimize import nnls

    f = np.array(features(rows))
    measured = np.array([r["measured"] for r in rows])
    cols = [i for i in range(4) if f[:, i].any()]
    names = ["hd64 attention", "bf16 matmuls", "float8 matmuls", "other kernels"]

    def solve(mask):
        w = 1 / measured[mask]
        c, _ = nnls(f[mask][:, cols] * w[:, None], (measured[mask] - f[mask, 4]) * w)
        return c

    c = solve(np.ones(len(rows), bool))
    lines = ["", "## The fit (multipliers of the estimate's parts; 1.00 = calibrated)", "",
             ", ".join(f"{names[i]} x{v:.3f}" for i, v in zip(cols, c)), "",
             "| row | measured s | fitted s | error | left out: predicted s | error |", "|---|---|---|---|---|---|"]
    for k, r in enumerate(rows):
        mask = np.ones(len(rows), bool)
        mask[k] = False
        pred = f[k, cols] @ c + f[k, 4]
        loo = f[k, cols] @ solve(mask) + f[k, 4]
        lines.append(f"| {r['label']} | {measured[k]:.3f} | {pred:.3f} | {pred / measured[k] - 1:+.1%} | {loo:.3f} | "
                     f"{loo / measured[k] - 1:+.1%} |")
    return lines


def _shown(path: pathlib.Path) -> str:
    """The path relative to the repository where it lies inside it."""
    try:
        return path.resolve().relative_to(HERE.parent).as_posix()
    except ValueError:
        return path.as_posix()


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_peers import gpu_kind, plan_of_row
    from results_io import run_header

    from ulysses_jax.model.config import ModelConfig

    rows = configurations(args.csv)
    if not rows:
        print(f"plan_vs_measured: {args.csv} has no row with ours_step_s; give a bench_peers.py CSV", file=sys.stderr)
        return 2
    for r in rows:
        p = plan_of_row(r, gpu_kind(r["gpu"]))
        r["estimate"], r["parts"] = p.estimate["step_seconds"], p.estimate["parts"]
        r["head_dim"] = ModelConfig.from_preset(r["model"]).head_dim
        r["label"] = f"{r['model']} {r['mode']} {int(r['seq_len']) // 1024}K `{r['flags']}`"
        print(f"{r['label']}: estimate {r['estimate']:.3f} s, measured {r['measured']:.3f} s", flush=True)
    kind = gpu_kind(rows[0]["gpu"])
    lines = [f"# plan's estimate beside the measured steps ({kind.upper()})", "",
             *[f"- {k}: `{v}`" for k, v in run_header().items()], "",
             f"Measured: `{_shown(args.csv)}` (ours_step_s). Estimate: `ulysses-jax plan` for the same flags on "
             f"one compile-only {kind.upper()} (compiled on the machine above).", "",
             "| row | measured s | estimate s | estimate / measured | attention ms | matmul ms (float8) | rest ms |",
             "|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in rows:
        q = r["parts"]
        ratio = r["estimate"] / r["measured"]
        worst = max(worst, abs(ratio - 1))
        rest = q["compute_s"] - q["attention_s"] - q["matmul_s"]
        lines.append(f"| {r['label']} | {r['measured']:.3f} | {r['estimate']:.3f} | {ratio:.2f} | "
                     f"{q['attention_s'] * 1e3:.0f} | {q['matmul_s'] * 1e3:.0f} ({q.get('matmul_fp8_s', 0) * 1e3:.0f}) "
                     f"| {rest * 1e3:.0f} |")
    lines += ["", f"Largest difference: {worst:.1%} of the measured step ({'within' if worst <= 0.10 else 'OVER'} "
                  "the 10% target)."]
    if args.fit:
        lines += fit(rows)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"plan_vs_measured_{kind}.md"
    out.write_text(text)
    print("wrote", out, f"({datetime.date.today()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
