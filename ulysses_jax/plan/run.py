"""What ``ulysses-jax plan`` does: plan, search or choose the memory tools, print the report and write the JSON, the
trials of a search written into it as they arrive (an interrupted search keeps what it found).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from ulysses_jax.plan.planner import Plan, PlanConfig, plan
from ulysses_jax.plan.report import format_plan
from ulysses_jax.plan.search import auto_fit, auto_memory, find_max_seq_len


def _trial(p: Plan) -> dict:
    return {"seq_len": p.seq_len, "fits": p.fits, "fits_device": p.fits_device, "fits_host": p.fits_host,
            "total_bytes": p.memory["total_bytes"], "host_bytes": p.memory["host_bytes"],
            "compile_seconds": round(p.compile_seconds, 1), "train_args": p.train_args,
            "step_seconds": (p.estimate or {}).get("step_seconds")}


class _Progress:
    """The JSON file of a search, rewritten after each compile: ``status`` "searching", the trials so far and the
    longest length verified within both budgets."""

    def __init__(self, path: pathlib.Path | None):
        self.path, self.trials, self.t0 = path, [], time.perf_counter()

    def __call__(self, p: Plan) -> None:
        self.trials.append(_trial(p))
        fitting = [t for t in self.trials if t["fits"]]
        self.write({"status": "searching", "elapsed_seconds": round(time.perf_counter() - self.t0, 1),
                    "longest_fitting_so_far": max(fitting, key=lambda t: t["seq_len"]) if fitting else None,
                    "trials": self.trials})

    def write(self, data: dict) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)


def run_plan(cfg: PlanConfig, *, log=print) -> Plan:
    """Plan (or search), print, and write the JSON if asked (``--json``)."""
    path = None if cfg.json is None else pathlib.Path(cfg.json)
    if path is not None and path.is_dir():
        raise ValueError(f"--json {cfg.json} is a directory; give a file path such as plan.json")
    hlo_path = None if cfg.hlo_out is None else pathlib.Path(cfg.hlo_out)
    if hlo_path is not None and hlo_path.is_dir():
        raise ValueError(f"--hlo-out {cfg.hlo_out} is a directory; give a file path such as step.hlo")
    progress = _Progress(path if cfg.find_max_seq_len or cfg.memory == "auto" else None)
    if progress.path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.find_max_seq_len:
        search = auto_memory if cfg.memory == "auto" else find_max_seq_len
        p = search(cfg, log=log, on_trial=progress)
    else:
        p = auto_fit(cfg, log=log, on_trial=progress) if cfg.memory == "auto" else plan(cfg)
    log(format_plan(p))
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_text(p.hlo_text)
        log(f"Optimised HLO of the planned step written to {hlo_path}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"status": "done", **p.to_json()}
        if progress.trials:
            out["search"] = {"trials": progress.trials, "wall_seconds": round(time.perf_counter() - progress.t0, 1)}
        progress.path = path
        progress.write(out)
    return p
