"""The benchmark scripts run (tiny CPU smoke configurations), so they cannot rot before a GPU session."""

import gzip
import json
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


def test_bench_delta_times_both_precisions(tmp_path):
    """experiments/bench_delta.py --allow-cpu --quick: a row per precision and walk of ours (fla and cuDNN need a GPU);
    each Pallas row's output equals the XLA walk's at its precision (interpret mode: to float32 rounding)."""
    import csv

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_delta.py"), "--allow-cpu", "--quick",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (path,) = tmp_path.glob("*.csv")
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]  # the run header's lines
    rows = [r for r in csv.DictReader(lines) if r["seq_len"] == "256"]
    assert [(r["precision"], r["impl"]) for r in rows] == [("highest", "xla"), ("highest", "pallas"), ("bf16", "xla"),
                                                           ("bf16", "pallas")]
    assert all(float(r["ours_s"]) > 0 for r in rows)
    assert all(float(r["max_abs_diff_vs_xla"]) < 1e-5 for r in rows if r["impl"] == "pallas")


def test_benchmarks_refuse_cpu_without_flag(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for script in ("bench_attention.py", "bench_train.py"):
        p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--out-dir", str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 2 and "pass --allow-cpu" in p.stderr


def test_bench_train_runs_an_earlier_package_and_fails_when_nothing_ran(monkeypatch, tmp_path):
    """The before of a before/after runs an earlier commit's package (first_contact.sh's baseline): a config field it
    lacks is left out when off and refused in one line when set; a run whose every row failed exits 1 (on a GPU the
    baseline's rows were lost to ``mlp_keep``, unknown to the earlier package, while the step said exit 0)."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_train

    @dataclasses.dataclass(frozen=True)
    class Earlier:  # an earlier ModelConfig: no mlp_keep, no scan_unroll
        attn_max_documents: int = 0

    later = {"mlp_keep": False, "scan_unroll": False, "attn_max_documents": 1}
    assert bench_train.known_fields(Earlier, later) == {"attn_max_documents": 1}
    with pytest.raises(SystemExit, match="has no mlp_keep .given True.; drop its flag"):
        bench_train.known_fields(Earlier, {**later, "mlp_keep": True})

    def fail(args, seq_len):
        raise TypeError("ModelConfig.__init__() got an unexpected keyword argument")

    monkeypatch.setattr(bench_train, "bench_one", fail)
    env_flags = os.environ.get("XLA_FLAGS")
    try:
        rc = bench_train.main(["--allow-cpu", "--quick", "--out-dir", str(tmp_path)])
    finally:  # main() sets the fake-device count when it is unset: leave the process's environment as it was
        if env_flags is None:
            os.environ.pop("XLA_FLAGS", None)
    assert rc == 1 and "TypeError" in next(tmp_path.glob("*.md")).read_text()


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


def test_next_calls_returns_what_a_killed_part_measured(tmp_path):
    """experiments/gpu/next_calls.sh packs the running part's results every PACK_EVERY seconds, so a call killed by the
    device's time limit (SIGKILL: no trap runs) still returns what it measured; the packer ends with the script. Run
    against a stand-in first_contact.sh that writes a line a second and never ends."""
    import shutil
    import signal
    import tarfile
    import time

    gpu = tmp_path / "repo" / "experiments" / "gpu"
    gpu.mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "gpu" / "next_calls.sh", gpu)
    (gpu / "first_contact.sh").write_text('mkdir -p "$OUT/results"; i=0\n'
                                          'while true; do i=$((i+1)); echo "row $i" >> "$OUT/results/rows.csv"; '
                                          'sleep 1; done\n')
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PACK_EVERY": "1", "ULYSSES_JAX_COMMIT": "test"}
    proc = subprocess.Popen(["bash", str(gpu / "next_calls.sh"), "A"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(5)
    proc.send_signal(signal.SIGKILL)  # the script alone, as a time limit kills the call's shell
    proc.wait()
    time.sleep(2)  # a packer that outlived the script would rewrite the archive here
    with tarfile.open(out / "a_1b_32k.tgz") as tar:
        rows = tar.extractfile("results/rows.csv").read().decode().splitlines()
    assert len(rows) >= 2, rows
    before = (out / "a_1b_32k.tgz").stat().st_mtime
    time.sleep(2)
    assert (out / "a_1b_32k.tgz").stat().st_mtime == before  # the packer ended with the script
    assert not list(out.glob("*.part"))
    os.killpg(proc.pid, signal.SIGKILL)  # the stand-in part, orphaned by the kill


@pytest.mark.slow
def test_bench_peers_dry_run(tmp_path):
    """experiments/bench_peers.py --allow-cpu --quick: ours and transformers (+peft) time the same tiny shapes in
    child processes, one packed row among them; the CSV has exactly the issue's columns; a peer that cannot run
    (Liger without a GPU) leaves its time empty and says why; --fill-estimates is covered by its own flags' parse
    (plan needs the aot extra)."""
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
    assert {r["mode"] for r in plain} == {"full", "lora16"} and len(plain) == 5
    assert {r["model"] for r in plain} == {"tiny", "tiny-hybrid"}  # the hybrid beside transformers' Qwen3_5
    assert [r["documents"] for r in plain] == ["1"] * 4 + ["4"]  # a packed row: the peer on per-document positions
    assert all(float(r["ours_step_s"]) > 0 and float(r["peer_step_s"]) > 0 for r in plain)
    assert all(abs(float(r["speedup"]) - float(r["peer_step_s"]) / float(r["ours_step_s"])) < 0.01 for r in plain)
    md = table.with_suffix(".md").read_text()
    # the hybrid's row says which delta rule transformers ran (its torch loop here: no fla on a CPU)
    hybrid = next(ln for ln in md.splitlines() if "tiny-hybrid" in ln and "| transformers |" in ln)
    assert "peer's delta rule: " in hybrid
    assert "transformers+liger" in md and ("liger_kernel" in md or float(
        next(r for r in rows if r["peer"] == "transformers+liger")["peer_step_s"] or 0) > 0)


def test_bench_peers_keeps_a_comparison_when_its_time_runs_out(monkeypatch):
    """Our first flag set, then the peers, then the rest of ours; the lines saved after each measurement (a peer not
    measured yet: an empty time and a note); past --deadline no child starts, and each child's timeout is cut to the
    time left (a review: the CSV was written after the whole row, and a row stopped at its limit left nothing)."""
    import argparse
    import time

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_peers

    calls, saved = [], []

    def fake_measure(spec, timeout):
        calls.append((spec["who"], spec.get("flags") or spec["peer"], timeout))
        return {"step_s": 1.0 if spec["who"] == "ours" else 1.5}

    monkeypatch.setattr(bench_peers, "measure", fake_measure)
    row = bench_peers.Row("r", "tiny", "full", 512, ("A", "B"))
    args = argparse.Namespace(steps=1, warmup=1, allow_cpu=True, timeout=200, ends_at=time.monotonic() + 100)
    out = bench_peers.rows_for(row, ["p1", "p2"], args, "cpu", "c", save=saved.append)
    assert [(w, f) for w, f, _ in calls] == [("ours", "A"), ("peer", "p1"), ("peer", "p2"), ("ours", "B")]
    assert all(90 <= t <= 95 for *_, t in calls)  # the time left less a margin, not --timeout's 200
    assert [len(s) for s in saved] == [2, 2, 2, 4]
    assert saved[0][0]["peer_step_s"] == "" and "time limit came first" in saved[0][0]["note"]
    assert [r["speedup"] for r in out] == ["1.50"] * 4
    calls.clear()
    args.ends_at = time.monotonic() + 8  # too little for any child: none starts
    out = bench_peers.rows_for(row, ["p1"], args, "cpu", "c")
    assert calls == [] and all("--deadline reached" in r["note"] for r in out)


def test_peer_without_checkpointing_keeps_its_activations(monkeypatch):
    """``transformers/no-checkpointing`` runs the peer's step without gradient checkpointing, the plain name with it
    (the peer always checkpointed before, while ours kept its products under SAVE: the ratio credited ours with a
    recompute the peer need not run where its activations fit). The peer does ours' work otherwise too (a review of
    the benchmark): the global norm clipped at 1 each step, bf16 autocast in LoRA mode as well."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "experiments"))
    import peer_step

    enabled, clipped, autocast = [], [], []
    real = transformers.PreTrainedModel.gradient_checkpointing_enable
    monkeypatch.setattr(transformers.PreTrainedModel, "gradient_checkpointing_enable",
                        lambda self, *a, **k: (enabled.append(type(self).__name__), real(self, *a, **k)))
    real_clip, real_autocast = torch.nn.utils.clip_grad_norm_, torch.autocast
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda ps, norm: (clipped.append(norm), real_clip(ps, norm))[1])
    monkeypatch.setattr(torch, "autocast", lambda **k: (autocast.append(k.get("enabled", True)), real_autocast(**k))[1])
    spec = dict(preset="tiny", mode="full", seq_len=64, documents=1, steps=1, warmup=1, allow_cpu=True)
    for name, mode, want in (("transformers", "full", 1), ("transformers/no-checkpointing", "full", 0),
                             ("transformers", "lora16", 1)):
        enabled.clear(), clipped.clear(), autocast.clear()
        out = peer_step.peer({**spec, "peer": name, "mode": mode})
        assert len(enabled) == want and out["step_s"] > 0 and out["loss"] > 0, name
        # each step clips the global norm at 1, as ours does; bf16 autocast in both modes (LoRA's peer ran its float32
        # adapters' GEMMs in float32 without it)
        assert clipped == [1.0, 1.0] and autocast == [True, True], (name, mode, clipped, autocast)
    # --peer-profile: the peer's attention kernels by name and device time (GPU only: a CPU run leaves the note out)
    assert "attention" not in peer_step.peer({**spec, "peer": "transformers", "profile": True})


def test_bench_peers_names_its_peers_and_ours_one_document_rows():
    """The profiled peer's note names its attention kernels and their share of the step's device time; ours' rows of
    one document take cuDNN's causal mask alone unless the flag set says otherwise; an unknown peer or variant is
    refused in one line."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_peers
    import peer_step

    note = peer_step.attention_kernels({"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 30.0,
                                        "pytorch_flash::flash_fwd_kernel": 10.0, "nvjet_sm90_tst_NNT": 60.0})
    assert note.startswith("peer's attention kernels 40.0 of 100.0 ms") and "sdpa_sm90_flash_bprop 30.0 ms" in note
    assert bench_peers.one_document("--remat full", 1) == "--remat full --attn-max-documents 1"
    assert bench_peers.one_document("--remat full --attn-max-documents 4", 1) == "--remat full --attn-max-documents 4"
    assert bench_peers.one_document("--remat full", 4) == "--remat full"
    assert bench_peers.known_peer("transformers+liger/no-checkpointing") and bench_peers.known_peer("transformers")
    assert not bench_peers.known_peer("transformers/nockpt") and not bench_peers.known_peer("torchtitan")
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_peers.py"), "--allow-cpu", "--quick",
                        "--peers", "transformers/nockpt"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown peer 'transformers/nockpt'" in p.stderr and len(p.stderr.splitlines()) == 1


@pytest.mark.slow
def test_fp8_curves_dry_run_with_both_recipes(tmp_path):
    """experiments/fp8_curves.py --fp8-recipe both on CPU: the baseline and a float8 run of each recipe, each run's
    metrics copied into the results as it ends, one table with both ratios."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "fp8_curves.py"), "--preset", "tiny", "--steps",
                        "3", "--seq-len", "128", "--allow-cpu", "--fp8-recipe", "both", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(x.name for x in tmp_path.glob("*.metrics.jsonl")) == [
        "fp8_curves_tiny_baseline.metrics.jsonl", "fp8_curves_tiny_fp8_current.metrics.jsonl",
        "fp8_curves_tiny_fp8_delayed.metrics.jsonl"]
    (md,) = tmp_path.glob("fp8_curves_tiny_cpu_*.md")
    text = md.read_text()
    assert "--fp8 (current) / baseline at the end" in text and "--fp8 (delayed) / baseline at the end" in text
    (table,) = tmp_path.glob("fp8_curves_tiny_cpu_*.csv")
    assert table.read_text().splitlines()[0] == "step,baseline,--fp8 (current),--fp8 (delayed)"


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
    # the steps ran the executable it categorised: every traced op named one of its instructions
    matched, traced = (int(x.replace(",", "")) for x in text.split(" device ops traced")[0].split("\n")[-1].split(
        " of the "))
    assert matched == traced > 0
    # beside the table: the compiled module and every op's time, whose sum is the device ops' busy time or more
    (hlo,) = tmp_path.glob("profile_tiny_*.hlo.txt.gz")
    (ops,) = tmp_path.glob("profile_tiny_*.ops.json.gz")
    assert "ENTRY" in gzip.open(hlo, "rt").read()
    busy_ms = float(text.split("device ops busy ")[1].split(" ms")[0])
    assert sum(ms for _, _, ms in json.load(gzip.open(ops, "rt"))) >= busy_ms - 0.5
    assert "| ms per step | launches a step | kernel |" in text


def test_profile_names_gpu_kernels_it_cannot_match():
    """A device op whose hlo_op names no instruction of the compiled module (every op of the first H100 profile) is
    categorised by its kernel's name: cuDNN's attention forward and backward, cuBLAS GEMMs, NCCL collectives."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from profile_step import breakdown, kernel_category

    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64") == (
        "attention forward")
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7") == "attention backward"
    assert kernel_category("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NNT") == "GEMMs"
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "GEMMs"
    assert kernel_category("ncclDevKernel_AllGather_RING_LL") == "collectives"
    assert kernel_category("loop_multiply_fusion_3") == "elementwise and copies"
    events = [(0.0, 10.0, "fusion.1", "sdpa_flash_fprop_x"), (10.0, 30.0, "fusion.2", "nvjet_gemm"),
              (30.0, 31.0, "add.3", "loop_add_fusion")]
    total, span = breakdown(events, {"add.3": "optimizer update"})  # the module's name first, where it matches
    assert total["attention forward"] == pytest.approx(10e-6) and total["GEMMs"] == pytest.approx(20e-6)
    assert total["optimizer update"] == pytest.approx(1e-6) and span == pytest.approx(31e-6)
    # inside a command buffer (the H200 profile of 2026-11-28) hlo_op names the buffer: the kernel's name, XLA's
    # fusion's with underscores, finds the instruction; a device-to-device memcpy is a copy, not a host transfer
    from profile_step import hlo_categories, op_category

    hlo = ('%gemm_fusion_dot.25 = bf16[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, '
           'metadata={op_name="jit(step)/transpose(jvp())/mlp/dot_general"}')
    cats = hlo_categories(hlo)
    assert op_category(cats, "command_buffer_3", "gemm_fusion_dot_25") == "MLP chunks"
    assert op_category(cats, "command_buffer_3", "memcpy32_post") == "elementwise and copies"
    assert op_category(cats, "MemcpyD2D", "copy") == "elementwise and copies"
    assert op_category(cats, "MemcpyH2D", "memcpy") == "host transfers"


def test_profile_from_stored_ops_categorises_them_anew(tmp_path):
    """--from-ops reads a stored profile (op times + compiled module) without a GPU: the ops inside a command buffer
    by their fusion's name, an old profile's device-to-device memcpy as a copy (the profiles of 2026-11-28 showed 0 ms
    of MLP and 19.6 ms of host transfers that were copies); a missing module is refused in one line."""
    stem = tmp_path / "profile_x_8192_nvidia-h200_1"
    hlo = ('%gemm_fusion_dot.25 = bf16[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, '
           'metadata={op_name="jit(step)/transpose(jvp())/mlp/dot_general"}\n'
           '%loop_add_fusion.2 = f32[8]{0} fusion(%d), kind=kLoop, calls=%e, '
           'metadata={op_name="jit(step)/optimizer/add"}')
    with gzip.open(f"{stem}.hlo.txt.gz", "wt") as f:
        f.write(hlo)
    ops = [["command_buffer_3", "gemm_fusion_dot_25", 40.0], ["command_buffer_3", "nvjet_sm90_tst_NNT", 30.0],
           ["command_buffer_9", "loop_add_fusion_2", 5.0], ["MemcpyD2D", "memcpy", 20.0],
           ["command_buffer_1", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", 100.0]]
    with gzip.open(f"{stem}.ops.json.gz", "wt") as f:
        json.dump(ops, f)
    pathlib.Path(f"{stem}.md").write_text("- measured step (host, mean of 2 traced steps): 196.0 ms; busy\n")
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_step.py"), "--from-ops",
                        f"{stem}.ops.json.gz"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    text = pathlib.Path(f"{stem}.by_category.md").read_text()
    rows = {r.split("|")[1].strip(): float(r.split("|")[2]) for r in text.splitlines()
            if r.startswith("| ") and r.split("|")[2].strip().replace(".", "").isdigit() and "%" in r}
    assert rows["MLP chunks"] == 40.0 and rows["GEMMs"] == 30.0 and rows["optimizer update"] == 5.0
    assert rows["elementwise and copies"] == 20.0 and rows["host transfers"] == 0.0
    assert rows["attention backward"] == 100.0 and "sum of the stored op times: 195.0 ms" in text
    assert "measured step (host, mean of 2 traced steps): 196.0 ms" in text
    # beside plan's parts (a plan --json of the same flags): the three largest differences named
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"estimate": {"parts": {"attention_s": 0.090, "matmul_s": 0.050, "elementwise_s": 0.02,
                                                       "update_s": 0.001}}}))
    pathlib.Path(f"{stem}.md").write_text("- measured step (host, mean of 2 traced steps): 196.0 ms; device ops busy "
                                          "190.0 ms (9 ops a step)\n")
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_step.py"), "--from-ops",
                        f"{stem}.ops.json.gz", "--plan-json", str(plan)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    text = pathlib.Path(f"{stem}.by_category.md").read_text()
    assert "| matmul_s (GEMMs, MLP chunks, tiled loss) | 50.0 | 70.0 | +20.0 |" in text
    assert "| idle gaps (plan: not counted) | 0.0 | 6.0 | +6.0 |" in text
    assert "Largest differences: matmul_s (+20.0 ms); attention_s (+10.0 ms); idle gaps (+6.0 ms)" in text
    pathlib.Path(f"{stem}.hlo.txt.gz").unlink()
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "profile_step.py"), "--from-ops",
                        f"{stem}.ops.json.gz"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "with its *.hlo.txt.gz beside it" in p.stderr and len(p.stderr.splitlines()) == 1


def test_plan_vs_measured_fit_recovers_known_multipliers():
    """experiments/plan_vs_measured.py --fit: rows made with hd64 attention x1.2, bf16 matmuls x1.5, float8 x2 and the
    other kernels x1.8 over the estimate's parts give those multipliers back, every row fitted exactly and each
    left-out row predicted."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from plan_vs_measured import fit

    rows = []
    for k, (attn, mm, f8, kern, rest, hd) in enumerate([
            (0.6, 0.4, 0.0, 0.05, 0.01, 64), (0.5, 0.4, 0.0, 0.03, 0.01, 64), (0.6, 0.3, 0.2, 0.06, 0.02, 64),
            (2.0, 1.7, 0.0, 0.1, 0.0, 128), (9.0, 1.5, 0.0, 0.2, 0.1, 64), (0.1, 0.7, 0.0, 0.3, 0.0, 128),
            (0.1, 0.2, 0.5, 0.1, 0.05, 128), (0.4, 0.2, 0.1, 0.4, 0.0, 64)]):
        parts = {"attention_s": attn, "matmul_s": mm + f8, "matmul_fp8_s": f8, "elementwise_s": kern * 0.75,
                 "update_s": kern * 0.25, "compute_s": attn + mm + f8 + kern + rest}
        measured = (1.2 * attn if hd == 64 else attn) + 1.5 * mm + 2.0 * f8 + 1.8 * kern + rest
        rows.append({"parts": parts, "head_dim": hd, "measured": measured, "label": f"row {k}"})
    lines = fit(rows)
    assert "hd64 attention x1.200, bf16 matmuls x1.500, float8 matmuls x2.000, other kernels x1.800" in lines
    table = [ln for ln in lines if ln.startswith("| row ") and not ln.startswith("| row |")]
    assert len(table) == 8 and all(ln.count("+0.0%") + ln.count("-0.0%") == 2 for ln in table), table


def test_bench_peers_gives_xla_tokens_to_our_child_alone(monkeypatch):
    """A flag set's ``XLA:<flag>`` tokens (the 8b-lora-8k row's float8 without Triton GEMMs) reach our child as its
    XLA_FLAGS and never bench_train's arguments; the peer's child gets no XLA_FLAGS."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_peers

    seen = []

    def run(cmd, **kw):
        seen.append((json.loads(cmd[-1]), kw["env"].get("XLA_FLAGS")))
        return subprocess.CompletedProcess(cmd, 0, stdout='RESULT {"step_s": 1.0}\n', stderr="")

    monkeypatch.setattr(bench_peers.subprocess, "run", run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    flags = "--remat full --fp8 " + bench_peers.NO_TRITON
    assert bench_peers.split_flags(flags) == (["--remat", "full", "--fp8"], ["--xla_gpu_enable_triton_gemm=false"])
    for spec in ({"who": "ours", "flags": flags}, {"who": "peer", "peer": "transformers"}):
        got = bench_peers.measure(spec, 10)
        assert got.pop("wall_s") >= 0 and got == {"step_s": 1.0}  # with the child's whole time, for planning calls
    assert [x for _, x in seen] == ["--xla_gpu_enable_triton_gemm=false", None]
    row = next(r for r in bench_peers.ROWS if r.name == "8b-lora-8k")
    assert any(bench_peers.NO_TRITON in f and "--fp8" in f for f in row.flag_sets)
    # --flag-sets: the module's named sets expanded, the rest kept as written
    assert bench_peers.flag_sets("SAVE|SAVE --fp8 NO_TRITON| --remat none ") == (
        bench_peers.SAVE, bench_peers.SAVE + " --fp8 " + bench_peers.NO_TRITON, "--remat none")
    # a dry run (--quick) of a GPU call's sets: nonzero chunks cut to 64 for the tiny rows' 512 tokens, zero kept
    assert bench_peers.quick_chunks(bench_peers.SAVE + " --fp8") == (
        "--remat save_matmuls --attn-keep --loss-chunk 64 --mlp-chunk 0 --fp8")
    assert bench_peers.quick_chunks("--loss-chunk 4096 --mlp-chunk 8192") == "--loss-chunk 64 --mlp-chunk 64"


def _stub_fla(tmp_path, monkeypatch, code: str):
    """A stand-in fla package whose ``fla.ops.gated_delta_rule`` module is ``code``, first on the PYTHONPATH of the
    processes started from here; ``(its folder, the new PYTHONPATH, experiments/bench_delta.py as a module)``."""
    stub = tmp_path / "stub"
    pkg = stub / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    for d in (pkg.parent.parent, pkg.parent):
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(code)
    path = os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import bench_delta
    finally:
        sys.path.pop(0)
    return stub, path, bench_delta


def test_bench_delta_times_fla_forward_when_its_backward_is_refused(tmp_path, monkeypatch):
    """bench_delta's fla child, on the CPU with a stand-in fla whose backward raises as fla >= 0.5 does on Hopper under
    Triton 3.4-3.7.0: the forward's time and output come back, the forward + backward's time is None and the note
    names the refusal (on the 2026-11-27 H100 the whole fla column stayed empty)."""
    import argparse

    import numpy as np

    pytest.importorskip("torch")
    _, _, bench_delta = _stub_fla(tmp_path, monkeypatch,
        "import torch\n\n\n"
        "class _Refused(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, v):\n"
        "        return v.clone()\n\n"
        "    @staticmethod\n"
        "    def backward(ctx, dv):\n"
        "        raise RuntimeError('Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results'\n"
        "                           '\\nsee #640')\n\n\n"
        "def chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False):\n"
        "    assert use_qk_l2norm_in_kernel and q.shape[2] == v.shape[2]\n"
        "    return _Refused.apply(v) * beta[..., None], None\n")
    rng = np.random.default_rng(3)
    x = {k: rng.standard_normal((1, 64, h, 16)).astype(np.float32)
         for k, h in (("q", 2), ("k", 2), ("v", 4), ("do", 4))}
    g, beta = -rng.random((1, 64, 4)).astype(np.float32), rng.random((1, 64, 4)).astype(np.float32)
    both, fwd, out, note = bench_delta.fla(x, g, beta, argparse.Namespace(iters=2, warmup=1))
    assert both is None and fwd > 0, (both, fwd, note)
    assert note.startswith("fla backward: Triton >= 3.4.0") and "\n" not in note
    import ml_dtypes

    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(out, bf(bf(x["v"]) * bf(beta)[..., None]))


def test_bench_delta_puts_the_fla_site_first_on_fla_s_path_alone(tmp_path, monkeypatch):
    """--fla-site (experiments/gpu/slim_triton.py's Triton 3.7.1 on the device): fla's child process imports the
    Triton found there, before any other on its path, and the note names it; the parent's path is untouched."""
    import argparse

    import numpy as np

    pytest.importorskip("torch")
    stub, path, bench_delta = _stub_fla(tmp_path, monkeypatch,
        "def chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False):\n"
        "    return v * beta[..., None], None\n")
    site = tmp_path / "site" / "triton"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("__version__ = '3.7.1-site'\n")
    decoy = stub / "triton"  # already on the path: the site's must come before it
    decoy.mkdir()
    (decoy / "__init__.py").write_text("__version__ = '3.6.0-image'\n")
    rng = np.random.default_rng(4)
    x = {k: rng.standard_normal((1, 32, h, 8)).astype(np.float32) for k, h in (("q", 2), ("k", 2), ("v", 2),
                                                                              ("do", 2))}
    g, beta = -rng.random((1, 32, 2)).astype(np.float32), rng.random((1, 32, 2)).astype(np.float32)
    args = argparse.Namespace(iters=1, warmup=1, fla_site=tmp_path / "site")
    both, fwd, _, note = bench_delta.fla(x, g, beta, args)
    assert both > 0 and fwd > 0 and note == "fla on Triton 3.7.1-site", note
    assert os.environ["PYTHONPATH"] == path
    assert bench_delta.parse_args(["--fla-site", "/x"]).fla_site == pathlib.Path("/x")
    monkeypatch.setenv("FLA_SITE", "/y")
    assert bench_delta.parse_args([]).fla_site == pathlib.Path("/y")
    # a site whose Triton breaks fla's process: fla runs again without it, and the note says so
    (site / "__init__.py").write_text("raise RuntimeError('built for another torch')\n")
    both, fwd, _, note = bench_delta.fla(x, g, beta, args)
    assert both > 0 and fwd > 0, note
    assert note.startswith("fla with --fla-site failed (RuntimeError: built for another torch), run without it: ")
    assert note.endswith("fla on Triton 3.6.0-image"), note


FILL_HLO = """HloModule fills

%fused_zeros () -> (f32[4,8,16], f32[4,8,16]) {
  %z = f32[] constant(0)
  %b = f32[4,8,16]{2,1,0} broadcast(%z), dimensions={}
  %c = f32[4,8,16]{1,2,0} copy(%b)
  ROOT %t = (f32[4,8,16]{2,1,0}, f32[4,8,16]{1,2,0}) tuple(%b, %c)
}

%fused_scaled (param_0.1: f32[8,16], param_1.1: f32[]) -> f32[8,16] {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  %param_1.1 = f32[] parameter(1)
  %s = f32[8,16]{1,0} broadcast(%param_1.1), dimensions={}
  ROOT %m = f32[8,16]{1,0} multiply(%param_0.1, %s)
}

%fused_dus (param_0.2: f32[4,8,16], param_1.2: f32[8,16], param_2.2: s32[]) -> f32[4,8,16] {
  %param_0.2 = f32[4,8,16]{2,1,0} parameter(0)
  %param_1.2 = f32[8,16]{1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %u = f32[1,8,16]{2,1,0} bitcast(%param_1.2)
  %zero = s32[] constant(0)
  ROOT %d = f32[4,8,16]{2,1,0} dynamic-update-slice(%param_0.2, %u, %param_2.2, %zero, %zero)
}

%body (t: (s32[], f32[4,8,16], f32[8,16])) -> (s32[], f32[4,8,16], f32[8,16]) {
  %t = (s32[], f32[4,8,16]{2,1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %buf = f32[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %dynamic_update_slice_fusion.3 = f32[4,8,16]{2,1,0} fusion(%buf, %x, %i), kind=kLoop, calls=%fused_dus
  ROOT %out = (s32[], f32[4,8,16]{2,1,0}, f32[8,16]{1,0}) tuple(%next, %dynamic_update_slice_fusion.3, %x)
}

%cond (t: (s32[], f32[4,8,16], f32[8,16])) -> pred[] {
  %t = (s32[], f32[4,8,16]{2,1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[8,16], k: f32[]) -> f32[4,8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %k = f32[] parameter(1)
  %zero = s32[] constant(0)
  %loop_broadcast_fusion.7 = (f32[4,8,16]{2,1,0}, f32[4,8,16]{1,2,0}) fusion(), kind=kLoop, calls=%fused_zeros
  %fill = f32[4,8,16]{2,1,0} get-tuple-element(%loop_broadcast_fusion.7), index=0
  %loop_broadcast_multiply_fusion = f32[8,16]{1,0} fusion(%p, %k), kind=kLoop, calls=%fused_scaled
  %copy.2 = f32[8,16]{0,1} copy(%p)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[8,16]{1,0}) tuple(%zero, %fill, %loop_broadcast_multiply_fusion)
  %w = (s32[], f32[4,8,16]{2,1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %res = f32[4,8,16]{2,1,0} get-tuple-element(%w), index=1
}
"""


def test_hlo_fills_counts_per_step():
    """A loop of 4 trips writing a 512 B slice into a zero-filled stacked buffer; the fill (2 KiB, with a copy of it in
    another layout: a fill still) once, a scaling (a broadcast of a parameter inside: arithmetic, not a fill) and a copy
    of 512 B once: 1 fill run of 4 KiB, 4 slice updates of 512 B each (the trip count multiplied in; the update's
    bytes, not the buffer's), 1 copy; all kernels: those, and the loop's counter add and compare (4 B, 1 B) 4 times."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import hlo_fills

    got = hlo_fills.fills(FILL_HLO)
    gib = 1 / 2**30
    assert got["zero fills"] == (1, 2 * 2048 * gib)
    assert got["slice updates"] == (4, 4 * 512 * gib)
    assert got["copies"] == (1, 512 * gib)
    assert got["all kernels"] == (1 + 1 + 1 + 4 + 4 + 4, (2 * 2048 + 512 + 512 + 4 * 512 + 4 * 4 + 4 * 1) * gib)


def test_hlo_traffic_counts_what_each_kernel_reads_and_writes():
    """The same loop, by bytes moved (read + written) per step and by op (no op_name here: the opcode): the fill writes
    its two 2 KiB buffers; the scaling reads 512 B and a 4 B scalar and writes 512 B; the copy reads and writes 512 B;
    each of the 4 slice updates reads its 512 B update and the 4 B index and writes 512 B, never the 2 KiB buffer it
    updates in place; the counter's add (4 B and two 4 B operands) and compare (1 B and two 4 B operands) 4 times."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import hlo_traffic

    got = hlo_traffic.traffic(FILL_HLO)
    gib = 1 / 2**30
    assert got["fusion"] == (1 + 1 + 4, (2 * 2048 + (512 + 4 + 512) + 4 * (512 + 4 + 512)) * gib)
    assert got["copy"] == (1, 2 * 512 * gib)
    assert got["add"] == (4, 4 * 12 * gib)
    assert got["compare"] == (4, 4 * 9 * gib)
    assert set(got) == {"fusion", "copy", "add", "compare"}


def test_seed_sweep_names_the_seeds_a_test_fails(tmp_path):
    """experiments/seed_sweep.py calls the test once a seed, with the other parameters given, and names the seeds
    that fail (exit 1); all passing exits 0; a malformed range or parameters are refused in one line."""
    body = "def test_even(seed, k):\n    assert (seed + k) % 2 == 0, f'odd {seed + k}'\n"
    (tmp_path / "test_odd.py").write_text(body)
    sweep = [sys.executable, str(ROOT / "experiments" / "seed_sweep.py"), f"{tmp_path / 'test_odd.py'}::test_even"]
    p = subprocess.run(sweep + ["--seeds", "3:7", "--kwargs", '{"k": 1}'], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    assert "seed 4: odd 5" in p.stdout and json.loads(p.stdout.splitlines()[-1])["failed"] == [4, 6]
    p = subprocess.run(sweep + ["--seeds", "2:3", "--kwargs", '{"k": 0}'], capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["failed"] == [], p.stderr
    p = subprocess.run(sweep + ["--seeds", "7:3"], capture_output=True, text=True)
    assert p.returncode == 2 and "--seeds '7:3' is not first:last" in p.stderr
    p = subprocess.run(sweep + ["--kwargs", "k=1"], capture_output=True, text=True)
    assert p.returncode == 2 and "--kwargs 'k=1' is not a JSON object" in p.stderr


def test_seed_sweep_of_a_file_sweeps_each_seeded_default_case(tmp_path):
    """Given a file alone, seed_sweep.py sweeps each parametrization of each default-suite test that takes ``seed``
    (one JSON line a case on stdout), passes over slow, skipped and unseeded tests, gives ``tmp_path`` and
    ``monkeypatch`` (new each seed: an empty directory, the last seed's setting undone), lists a case that needs another
    fixture as not run, and exits 1 if any seed failed; --kwargs with a file is refused."""
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('k', [0, 1])\ndef test_even(seed, k):\n    assert (seed + k) % 2 == 0, 'odd'\n\n"
        "@pytest.mark.slow\ndef test_slow(seed):\n    assert False\n\n"
        "@pytest.mark.skip(reason='off')\ndef test_skipped(seed):\n    assert False\n\n"
        "def test_unseeded():\n    assert False\n\n"
        "def test_needs_tmp(seed, tmp_path):\n    assert not list(tmp_path.iterdir())\n"
        "    (tmp_path / 'x').write_text('x')\n\n"
        "import os\n\ndef test_needs_monkeypatch(seed, monkeypatch):\n    assert 'SWEEP_X' not in os.environ\n"
        "    monkeypatch.setenv('SWEEP_X', '1')\n\n"
        "def test_needs_capsys(seed, capsys):\n    pass\n")
    sweep = [sys.executable, str(ROOT / "experiments" / "seed_sweep.py"), str(tmp_path / "test_many.py")]
    p = subprocess.run(sweep + ["--seeds", "3:6"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    cases = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [(c["test"].split("::")[1], c.get("failed")) for c in cases] == [
        ("test_even[0]", [3, 5]), ("test_even[1]", [4]), ("test_needs_tmp", []), ("test_needs_monkeypatch", []),
        ("test_needs_capsys", None)], p.stdout
    assert "needs the fixtures ['capsys']" in cases[-1]["not_run"]
    p = subprocess.run(sweep + ["--seeds", "4:5", "--kwargs", '{"k": 1}'], capture_output=True, text=True)
    assert p.returncode == 2 and "--kwargs is for one test" in p.stderr
