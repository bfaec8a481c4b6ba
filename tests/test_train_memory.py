"""``train --memory auto``: a new run on an H100 or H200 given no memory flag takes the set of memory tools of the
shortest estimated step among those that fit (``plan --memory auto``'s search for its own model, mesh, batch and
length), and says so in one line; a memory flag given, ``--memory manual``, CPU devices and other GPUs search nothing.
The search runs on stand-in plans (memory and step time known functions of the flags): no compile."""

import dataclasses
import json
import types

import jax
import pytest

from ulysses_jax.cli import EXIT_OVER, main, parse
from ulysses_jax.plan import search, train_memory
from ulysses_jax.plan.planner import PlanConfig
from ulysses_jax.plan.search import NothingFits
from ulysses_jax.plan.targets import TARGETS
from ulysses_jax.plan.train_memory import WHY, Job, decide, target_for
from ulysses_jax.train.config import TrainConfig, memory_flags_given

GiB = 2**30
H100 = "NVIDIA H100 80GB HBM3"


def job(platform="gpu", kind=H100, sp=8, memory_fraction=0.95) -> Job:
    return Job(platform=platform, device_kind=kind, devices=sp, hosts=1,
               mesh={"data": 1, "fsdp": 1, "ring": 1, "sp": sp}, batch_size=1, memory_fraction=memory_fraction,
               host_memory_gib=100.0)


def step_seconds(cfg: PlanConfig) -> float:
    """Stand-in estimates: kept matmuls fastest, then full remat (faster with the MLP's products kept), offload
    slowest, the tiled attention slower still."""
    return ({"save_matmuls": 1.2, "full": 1.3, "offload": 2.0}[cfg.remat] + 0.5 * bool(cfg.attn_chunk)
            - 0.05 * cfg.attn_keep - 0.03 * cfg.mlp_keep + 0.1 * ((cfg.remat_every or 1) - 1))


def stand_in(monkeypatch, *, device_bytes=lambda cfg: 30 * GiB, sp=8, step=step_seconds):
    """``search.plan`` and ``search._mesh`` replaced: each set's plan from ``device_bytes`` and ``step`` (estimates);
    returns the PlanConfigs the search planned."""
    planned = []

    def plan(cfg, seq_len=None, detail=True, **_):
        planned.append(cfg)
        mem = {"total_bytes": device_bytes(cfg), "host_bytes": 0,
               "budget_bytes": int(cfg.budget_fraction * TARGETS[cfg.target].memory_bytes),
               "host_budget_bytes": int(cfg.host_memory_gib * GiB)}
        p = types.SimpleNamespace(seq_len=cfg.seq_len, memory=mem, compile_seconds=0.0, max_seq_len=None,
                                  memory_flags=None, train_args=[], alternatives=[],
                                  estimate={"step_seconds": step(cfg), "tokens_per_second_per_gpu": 1.0})
        p.fits = mem["total_bytes"] <= mem["budget_bytes"]
        return p

    monkeypatch.setattr(search, "plan", plan)
    monkeypatch.setattr(search, "_mesh", lambda cfg, model, n: (None, types.SimpleNamespace(
        shape={"ring": 1, "sp": sp})))
    return planned


def no_search(*_, **__):
    raise AssertionError("searched")


def test_no_memory_flag_on_a_gpu_takes_the_fastest_set_that_fits_and_says_why(monkeypatch):
    planned = stand_in(monkeypatch, device_bytes=lambda cfg: (90 if cfg.remat == "save_matmuls" or cfg.mlp_keep
                                                               else 30) * GiB)
    lines = []
    cfg = TrainConfig(preset="tiny", seq_len=8 * 12_000, batch_size=1)
    picked, why = decide(cfg, job(), log=lines.append, log_file=False, agree=lambda outcome: None)
    # the kept matmuls (or MLP products) would be fastest but take 90 GiB: over the budget; the fastest that fits
    # keeps attention
    assert (picked.remat, picked.attn_keep, picked.loss_chunk, picked.mlp_chunk) == ("full", True, 4000, 4000)
    assert picked.remat_every is None and picked.optim == cfg.optim and why == WHY
    assert memory_flags_given(picked) and not memory_flags_given(cfg)
    first = planned[0]  # the run's own job: its devices, mesh, batch and length, the budgets of this machine
    assert (first.target, first.devices, first.hosts, first.batch_size, first.seq_len) == ("h100", 8, 1, 1, 96_000)
    assert first.mesh.sp == 8 and first.mesh.fsdp == 1 and first.host_memory_gib == 100.0
    assert first.budget_fraction == pytest.approx(0.9) and not first.kernels
    assert len(lines) == 2 and lines[0].startswith("memory: no memory flag given (--memory auto): compiling")
    fits = sum(c.remat != "save_matmuls" and not c.mlp_keep for c in planned)
    assert lines[1] == (
        f"memory: --remat full --attn-keep --loss-chunk 4000 --mlp-chunk 4000 (--memory auto, no memory flag given: "
        f"the shortest estimated step (within 2%, the least memory where none needs at most 75% of the budget and no "
        f"host memory), 1.250 s, of the {fits} sets that fit 71.2 GiB "
        f"per H100 and 100.0 GiB of host memory per GPU; the next fastest 1.300 s; {len(planned)} compiled in 0 s; "
        f"--memory manual keeps the preset's)")


def test_the_line_names_a_faster_set_that_took_more_memory(monkeypatch):
    """Within 2% of the fastest estimate the set needing the least memory wins where the fastest needs over 75% of the
    budget; the line says the faster one exists and why it lost (kept matmuls 1.24 s in 60 GiB of 71.2 against kept
    attention's 1.25 s in 30 GiB)."""
    stand_in(monkeypatch, device_bytes=lambda cfg: (60 if cfg.remat == "save_matmuls" else 90 if cfg.mlp_keep
                                                    else 30) * GiB,
             step=lambda cfg: step_seconds(cfg) + 0.09 * (cfg.remat == "save_matmuls"))
    lines = []
    picked, _ = decide(TrainConfig(preset="tiny", seq_len=8 * 12_000, batch_size=1), job(), log=lines.append,
                       log_file=False, agree=lambda outcome: None)
    assert (picked.remat, picked.attn_keep, picked.mlp_keep) == ("full", True, False)
    assert "host memory), 1.250 s, of the" in lines[1] and "; the fastest 1.240 s, within 2% of it in more memory;" in (
        lines[1])


@pytest.mark.parametrize("args", [[], ["--no-scan-unroll"], ["--scan-unroll"]])
def test_one_gpu_trains_the_chosen_set_unrolled_unless_the_loop_is_given(monkeypatch, args):
    """On one GPU the chosen set is tried with its layer loop unrolled (5% faster here, in the same memory) and
    trained so; ``--no-scan-unroll`` keeps the loop, ``--scan-unroll`` unrolls every set (no extra trial)."""
    from ulysses_jax.cli import _given

    planned = stand_in(monkeypatch, sp=1, step=lambda cfg: step_seconds(cfg) * (0.95 if cfg.scan_unroll else 1))
    cfg = parse(["train", "--preset", "tiny", "--seq-len", "32768", *args])
    one = dataclasses.replace(job(sp=1), devices=1)
    picked, _ = decide(cfg, one, given=_given(args), log=lambda line: None, log_file=False,
                       agree=lambda outcome: None)
    assert picked.scan_unroll == (args != ["--no-scan-unroll"])
    assert sum(c.scan_unroll for c in planned) == {(): 1, ("--no-scan-unroll",): 0}.get(tuple(args), len(planned))
    assert (picked.remat, picked.attn_keep) == ("save_matmuls", True)


def test_a_smaller_memory_pool_lowers_the_device_budget(monkeypatch):
    planned = stand_in(monkeypatch)
    decide(TrainConfig(preset="tiny", seq_len=8 * 4096, memory_fraction=0.76), job(memory_fraction=0.76),
           log=lambda line: None, log_file=False, agree=lambda outcome: None)
    assert planned[0].budget_fraction == pytest.approx(0.72)


@pytest.mark.parametrize("args, named", [
    (["--remat", "full"], "--remat"),
    (["--no-attn-keep"], "--attn-keep"),  # at its default, but given: the user's choice
    (["--loss-chunk", "0", "--optim.offload"], "--loss-chunk, --optim.offload"),
])
def test_a_memory_flag_given_searches_nothing(args, named):
    from ulysses_jax.cli import _given

    lines = []
    cfg = parse(["train", *args])
    assert decide(cfg, job(), given=_given(args), search=no_search, log=lines.append) == (cfg, None)
    assert lines == [f"memory: the flags given ({named}); --memory auto searches only when no memory flag is given"]


def test_a_memory_setting_in_the_config_file_counts_as_given(tmp_path):
    from ulysses_jax.cli import _given

    (tmp_path / "c.yaml").write_text("seq_len: 4096\nattn_keep: false\n")
    args = ["--config", str(tmp_path / "c.yaml")]
    assert memory_flags_given(parse(["train", *args]), _given(args)) == ["--attn-keep"]
    (tmp_path / "c.yaml").write_text("seq_len: 4096\nmesh: {sp: 8}\n")
    assert memory_flags_given(parse(["train", *args]), _given(args)) == []


def test_cpu_manual_and_other_gpus_search_nothing():
    cfg = TrainConfig(preset="tiny")
    lines = []
    assert decide(cfg, job(platform="cpu"), search=no_search, log=lines.append) == (cfg, None) and not lines
    manual = TrainConfig(preset="tiny", memory="manual")
    assert decide(manual, job(), search=no_search, log=lines.append) == (manual, None) and not lines
    assert decide(cfg, job(kind="NVIDIA A100-SXM4-80GB"), search=no_search, log=lines.append) == (cfg, None)
    assert lines == ["memory: the preset's tools, no search (plan compiles for H100 and H200 only, not NVIDIA "
                     "A100-SXM4-80GB); memory flags change them, --memory manual drops this line"]
    assert [target_for(k) for k in (H100, "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA GH200 480GB", "cpu")] == [
        "h100", "h100", "h200", None, None]


def test_nothing_fits_is_one_sentence_naming_the_fix(monkeypatch):
    stand_in(monkeypatch, device_bytes=lambda cfg: 200 * GiB)
    with pytest.raises(NothingFits) as e:
        decide(TrainConfig(preset="tiny", seq_len=8 * 12_000, batch_size=1), job(), log=lambda line: None,
               log_file=False, agree=lambda outcome: None)
    text = str(e.value)
    assert text.startswith("no set of memory tools fits --seq-len 96000 with batch 1 on these 8 H100s within 71.2 GiB "
                           "per device and 100.0 GiB of host memory per GPU")
    assert "train on more GPUs or at a shorter --seq-len" in text and "--find-max-seq-len" in text
    assert text.count(". ") == 0 and "\n" not in text


def test_a_search_that_cannot_compile_keeps_the_flags_as_given(monkeypatch):
    def fail(*_, **__):
        raise jax.errors.JaxRuntimeError("INTERNAL: ptxas exited with a failure")

    lines, cfg = [], TrainConfig(preset="tiny")
    assert decide(cfg, job(), search=fail, log=lines.append, log_file=False, agree=lambda o: None) == (cfg, None)
    assert lines[-1] == ("memory: the preset's tools, the search failed (INTERNAL: ptxas exited with a failure); give "
                         "memory flags, or --memory manual")


def test_processes_that_searched_otherwise_are_refused_alike(monkeypatch):
    monkeypatch.setattr(train_memory, "gather", lambda outcome: [outcome, "--remat full"])
    train_memory._agree("--remat full")
    with pytest.raises(ValueError, match=r"other memory tools on other processes \('--remat offload' on process 0"):
        train_memory._agree("--remat offload")


def _on_an_h100(monkeypatch, tmp_path):
    """``train``'s job described as one on 8 H100s (it runs on the 8 fake CPU devices), its search log in tmp_path."""
    real = train_memory.job_of
    monkeypatch.setattr(train_memory, "job_of", lambda *a: dataclasses.replace(real(*a), platform="gpu",
                                                                               device_kind=H100, host_memory_gib=100.0))
    monkeypatch.setattr(train_memory.xla_log, "default_path", lambda: str(tmp_path / "search.log"))


TINY = ["--preset", "tiny", "--seq-len", "256", "--attention", "xla", "--no-progress", "--mesh.fsdp", "2",
        "--mesh.sp", "4"]


def test_train_applies_records_and_says_the_choice(monkeypatch, tmp_path, capsys):
    """The CLI end to end: the chosen tools train (here on the CPU devices), the start line says them, run.json
    records them among the settings no flag gave, with why."""
    stand_in(monkeypatch, device_bytes=lambda cfg: (90 if cfg.attn_keep else 30) * GiB, sp=4)
    _on_an_h100(monkeypatch, tmp_path)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    said = [ln for ln in out.splitlines() if ln.startswith("memory: ")]
    assert len(said) == 2 and said[1].startswith(
        "memory: --remat full (--memory auto, no memory flag given: the shortest estimated step (within 2%, the least "
        "memory where none needs at most 75% of the budget and no host memory), 1.300 s, of the ")
    assert f"each in {tmp_path / 'search.log'}" in said[1] and "--remat full" in (tmp_path / "search.log").read_text()
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["remat"] == "full" and record["compute"]["remat"] == "full"
    assert record["defaults"]["remat"] == {"value": "full", "why": WHY}


def test_train_when_nothing_fits_exits_1_in_one_line_writing_nothing(monkeypatch, tmp_path, capsys):
    stand_in(monkeypatch, device_bytes=lambda cfg: 200 * GiB, sp=4)
    _on_an_h100(monkeypatch, tmp_path)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--run-dir", str(run)]) == EXIT_OVER == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no set of memory tools fits --seq-len 256"), err
    assert not run.exists()


@pytest.mark.aot
@pytest.mark.slow
def test_the_real_search_on_compile_only_h100s(tmp_path, monkeypatch):
    """``decide`` with ``search.auto_fit`` compiling each set for one compile-only H100: it picks one of the sets,
    whose flags, given to ``train``, are the config it returns."""
    monkeypatch.setattr(train_memory.xla_log, "default_path", lambda: str(tmp_path / "search.log"))
    one = Job(platform="gpu", device_kind=H100, devices=1, hosts=1, mesh={"data": 1, "fsdp": 1, "ring": 1, "sp": 1},
              batch_size=1, memory_fraction=0.95, host_memory_gib=100.0)
    lines = []
    cfg = TrainConfig(preset="tiny", seq_len=2048)
    picked, why = decide(cfg, one, log=lines.append, agree=lambda outcome: None)
    flags = lines[-1].removeprefix("memory: ").split(" (--memory auto")[0]
    assert why == WHY and flags in (tmp_path / "search.log").read_text()
    assert parse(["train", "--preset", "tiny", "--seq-len", "2048", *flags.split()]) == picked


@pytest.mark.parametrize("local, processes", [(8, 1), (1, 8)])
def test_the_host_budget_is_shared_by_the_hosts_gpus_however_processes_drive_them(monkeypatch, local, processes):
    """One process driving 8 GPUs and 8 processes of one GPU each share a host's memory over its 8 GPUs alike (one GPU
    a process took the whole machine's share per GPU: 8x the pinned memory there is; found by a review)."""
    import numpy as np

    dev = types.SimpleNamespace(device_kind=H100, platform="gpu")
    mesh = types.SimpleNamespace(devices=np.array([dev] * 8, dtype=object), shape=dict(data=1, fsdp=1, ring=1, sp=8))
    monkeypatch.setattr(train_memory, "device_platform", lambda m: "gpu")
    monkeypatch.setattr(jax, "local_device_count", lambda: local)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    job = train_memory.job_of(TrainConfig(), mesh, 1)
    assert job.hosts == 1 and job.host_memory_gib == pytest.approx(train_memory.host_memory_gib(8))


def test_an_unrolled_loop_chosen_by_auto_is_recorded_as_its_choice(tmp_path):
    """``train``'s record names every setting ``--memory auto`` chose, with why, the layer loop unrolled among them
    (``scan_unroll`` is not a memory flag: given alone it does not stop the search); the run trains unrolled."""
    from ulysses_jax.train.config import memory_changes
    from ulysses_jax.train.devices import MeshConfig
    from ulysses_jax.train.trainer import setup_train

    cfg = TrainConfig(preset="tiny", batch_size=2, seq_len=128, steps=2, progress=False, attention="xla",
                      mesh=MeshConfig(fsdp=2, sp=4), run_dir=str(tmp_path / "run"))
    picked = dataclasses.replace(cfg, remat="full", scan_unroll=True)
    assert memory_changes(cfg, picked) == {"remat": "full"} and not memory_flags_given(
        dataclasses.replace(cfg, scan_unroll=True))
    run = setup_train(cfg, memory_setup=lambda c, mesh, batch_size: (picked, WHY))
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["defaults"]["scan_unroll"] == {"value": True, "why": WHY}
    assert record["defaults"]["remat"] == {"value": "full", "why": WHY}
    assert record["config"]["scan_unroll"] is True and run.model.scan_unroll
