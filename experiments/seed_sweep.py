"""Run one test's body over a range of seeds and count the seeds it fails: how a random-input test's bound was checked
against its tail (the float8 tests' figures of 2026-11-29 came from sweeps like these).

    python experiments/seed_sweep.py tests/test_fp8.py::test_float8_model_is_close_to_the_bf16_model --seeds 4000:4300
    python experiments/seed_sweep.py tests/test_fp8.py::test_eight_devices_equal_one --kwargs '{"case": "plain"}' \\
        --seeds 2000:2300

The test is called as a function with ``seed=`` and the JSON ``--kwargs`` (its other parameters), in one process set
up as ``tests/conftest.py`` sets the suite up (8 CPU devices, the same compile flags), so each program compiles once
and a seed costs its run alone. Fixtures other than ``seed``, ``tmp_path`` and ``monkeypatch`` (new for each seed)
are not provided. Prints each failing seed with the first line of its assertion and, last, one JSON line: the test, its
parameters, the seeds run, the seeds that failed.

Given a file alone, every test of it in the default suite (``-m "not slow and not gpu"``, not skipped) that takes
``seed`` is swept, each of its parametrizations in turn: one JSON line a case as it ends; ``tmp_path`` and
``monkeypatch`` are given (new for each seed), a case that needs another fixture is listed as not run. Each
program still compiles once a case (a test that jits a new function per call compiles per seed, from the persistent
cache where it hits):

    python experiments/seed_sweep.py tests/test_kept_attention.py --seeds 7000:7020
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test", help="tests/<file>.py::<test function>, or tests/<file>.py: its seeded default tests")
    p.add_argument("--seeds", default="0:100", help="first:last (last excluded)")
    p.add_argument("--kwargs", default="{}", help="the test's other parameters, as a JSON object")
    args = p.parse_args(argv)
    path, _, name = args.test.partition("::")
    first, _, last = args.seeds.partition(":")
    if not path.endswith(".py") or (not name and "::" in args.test):
        p.error(f"the test {args.test!r} is not <file>.py::<function> or <file>.py, "
                f"e.g. tests/test_fp8.py::test_refusals")
    if not (first.isdigit() and last.isdigit() and int(first) < int(last)):
        p.error(f"--seeds {args.seeds!r} is not first:last with first < last, e.g. 0:100")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        p.error(f"--kwargs {args.kwargs!r} is not a JSON object, e.g. '{{\"case\": \"plain\"}}'")
    if not name and kwargs:
        p.error(f"--kwargs is for one test; {path} alone sweeps each parametrization of each of its tests")
    test_file = ROOT / path
    if not test_file.is_file():
        p.error(f"no test file {path!r} (from {ROOT}); give tests/<file>.py")
    folder = test_file.parent
    sys.path.insert(0, str(folder))
    os.environ.setdefault("ULYSSES_TEST_SEED", "0")
    seeds = range(int(first), int(last))
    if not name:
        return _sweep_file(test_file, seeds)
    if (folder / "conftest.py").exists():
        importlib.import_module("conftest")  # the suite's XLA flags and 8 CPU devices, before jax starts
    test = getattr(importlib.import_module(test_file.stem), name)
    start = time.time()
    failed = _sweep(test, kwargs, seeds)
    print(json.dumps(dict(test=args.test, kwargs=kwargs, seeds=args.seeds, failed=failed,
                          seconds=round(time.time() - start))))
    return 1 if failed else 0


# fixtures the sweep gives a test beside ``seed``, new for each seed: ``tmp_path`` (an empty directory) and
# ``monkeypatch`` (pytest's, undone after the seed)
PROVIDED = ("tmp_path", "monkeypatch")


def _sweep(test, kwargs: dict, seeds) -> list[int]:
    """The seeds for which ``test(**kwargs, seed=s)`` raises AssertionError, each printed with its message; a test
    that takes ``tmp_path`` or ``monkeypatch`` gets a new one for each seed (``PROVIDED``)."""
    import pytest

    failed = []
    wants = [f for f in PROVIDED if f in inspect.signature(test).parameters and f not in kwargs]
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix=f"seed_sweep_{seed}_") as tmp, pytest.MonkeyPatch.context() as mp:
            given = {"tmp_path": pathlib.Path(tmp), "monkeypatch": mp}
            try:
                test(**kwargs, seed=seed, **{f: given[f] for f in wants})
            except AssertionError as e:
                failed.append(seed)
                print(f"seed {seed}: {(str(e).splitlines() or ['(no message)'])[0][:300]}", flush=True)
    return failed


class _Seeded:
    """pytest plugin: the collected default-suite items whose test function takes ``seed``."""

    def __init__(self):
        self.items = []

    def pytest_collection_finish(self, session):
        for item in session.items:
            fn = getattr(item, "function", None)
            skipped = any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
                          for m in item.iter_markers())
            if fn is not None and "seed" in inspect.signature(fn).parameters and not skipped:
                self.items.append(item)


def _sweep_file(test_file: pathlib.Path, seeds) -> int:
    """Each seeded default test case of ``test_file`` over ``seeds``: one JSON line a case; 1 if any seed failed."""
    import pytest

    seeded = _Seeded()
    with contextlib.redirect_stdout(sys.stderr):  # stdout: the JSON lines alone
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
                          str(test_file)], plugins=[seeded])
    if rc not in (0, 5):  # 5: nothing collected
        print(f"collecting {test_file} failed (pytest exit {rc})", file=sys.stderr)
        return 2
    any_failed = False
    for item in seeded.items:
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        others = [f for f in inspect.signature(item.function).parameters
                  if f != "seed" and f not in params and f not in PROVIDED]
        if others:
            print(json.dumps(dict(test=item.nodeid, not_run=f"needs the fixtures {others}")), flush=True)
            continue
        start = time.time()
        failed = _sweep(item.function, params, seeds)
        any_failed |= bool(failed)
        print(json.dumps(dict(test=item.nodeid, seeds=f"{seeds.start}:{seeds.stop}", failed=failed,
                              seconds=round(time.time() - start))), flush=True)
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
