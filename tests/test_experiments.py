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


@pytest.mark.slow
def test_bench_peers_dry_run(tmp_path):
    """experiments/bench_peers.py --allow-cpu --quick: ours and transformers (+peft) time the same tiny shapes in
    child processes; the CSV has exactly the issue's columns; a peer that cannot run (Liger without a GPU) leaves its
    time empty and says why; --fill-estimates is covered by its own flags' parse (plan needs the aot extra)."""
    import csv

    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_peers.py"), "--allow-cpu", "--quick",
                        "--steps", "1", "--warmup", "1", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (table,) = tmp_path.glob("peers_cpu_*.csv")
    rows = list(csv.DictReader(open(table)))
    assert list(rows[0]) == ["model", "mode", "seq_len", "documents", "flags", "peer", "ours_step_s", "peer_step_s",
                             "speedup", "estimate_s", "ours_peak_gib", "peer_peak_gib", "gpu", "date", "commit"]
    plain = [r for r in rows if r["peer"] == "transformers"]
    assert {r["mode"] for r in plain} == {"full", "lora16"} and len(plain) == 3
    assert all(float(r["ours_step_s"]) > 0 and float(r["peer_step_s"]) > 0 for r in plain)
    assert all(abs(float(r["speedup"]) - float(r["peer_step_s"]) / float(r["ours_step_s"])) < 0.01 for r in plain)
    md = table.with_suffix(".md").read_text()
    assert "transformers+liger" in md and ("liger_kernel" in md or float(
        next(r for r in rows if r["peer"] == "transformers+liger")["peer_step_s"] or 0) > 0)


@pytest.mark.slow
def test_profile_step_dry_run(tmp_path):
    """experiments/profile_step.py --allow-cpu --quick: a trace of the step's device ops sorted into the categories,
    which with the idle gaps sum to the measured step."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_step.py"), "--allow-cpu", "--quick",
                        "--sp", "1", "--fsdp", "1", "--batch-size", "1", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (table,) = tmp_path.glob("profile_tiny_*.md")
    text = table.read_text()
    step_ms = float(text.split("measured step (host, mean of 3 traced steps): ")[1].split(" ms")[0])
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in text.splitlines() if r.startswith("| ")}
    for c in ("MLP chunks", "tiled loss", "optimizer update", "GEMMs", "idle gaps (no device op)"):
        assert c in rows, c
    assert float(rows["MLP chunks"]) > 0 and float(rows["tiled loss"]) > 0 and float(rows["optimizer update"]) > 0
    assert abs(float(rows["**sum**"]) - step_ms) <= 0.2
