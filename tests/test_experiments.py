"""The benchmark scripts run (tiny CPU smoke configurations), so they cannot rot before a GPU session."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_train.py"])
def test_benchmark_smoke(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--allow-cpu", "--quick",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    tables = list(tmp_path.glob("*.md"))
    assert len(tables) == 1 and list(tmp_path.glob("*.csv"))
    text = tables[0].read_text()
    assert "- date:" in text and "- commit:" in text and "- command:" in text
    rows = [r.strip("|").split("|") for r in text.splitlines() if r.startswith("| ") and "---" not in r]
    header, body = [c.strip() for c in rows[0]], rows[1:]
    ours = [r for r in body if script == "bench_train.py" or r[0].strip() in ("ours", "xla")]
    assert ours and all(r[header.index("note")].strip() == "" for r in ours)  # our rows ran (cuDNN needs a GPU)


def test_benchmarks_refuse_cpu_without_flag(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for script in ("bench_attention.py", "bench_train.py"):
        p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--out-dir", str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 2 and "pass --allow-cpu" in p.stderr


@pytest.mark.slow
def test_gpu_first_contact_dry_run(tmp_path):
    """experiments/gpu/first_contact.sh --dry-run on CPU: every step runs (tiny sizes; GPU tests skipped) and exits 0,
    the summary names each, and the results folder is packed (what a lent GPU session runs, minus the GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path))
    p = subprocess.run(["bash", str(ROOT / "experiments" / "gpu" / "first_contact.sh"), "--dry-run"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = (tmp_path / "results" / "summary.txt").read_text()
    for step in ("env", "tests_gpu", "attention_bench", "train_bench_auto", "train_bench_keep"):
        assert f"{step}: exit 0 in " in summary, summary
    assert (tmp_path / "results.tgz").stat().st_size > 0
