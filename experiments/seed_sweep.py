"""Run one test's body over a range of seeds and count the seeds it fails: how a random-input test's bound was checked
against its tail (the float8 tests' figures of 2026-11-29 came from sweeps like these).

    python experiments/seed_sweep.py tests/test_fp8.py::test_float8_model_is_close_to_the_bf16_model --seeds 4000:4300
    python experiments/seed_sweep.py tests/test_fp8.py::test_eight_devices_equal_one --kwargs '{"case": "plain"}' \\
        --seeds 2000:2300

The test is called as a function with ``seed=`` and the JSON ``--kwargs`` (its other parameters), in one process set
up as ``tests/conftest.py`` sets the suite up (8 CPU devices, the same compile flags), so each program compiles once
and a seed costs its run alone. Fixtures other than ``seed`` are not provided. Prints each failing seed with the first
line of its assertion and, last, one JSON line: the test, its parameters, the seeds run, the seeds that failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test", help="tests/<file>.py::<test function>")
    p.add_argument("--seeds", default="0:100", help="first:last (last excluded)")
    p.add_argument("--kwargs", default="{}", help="the test's other parameters, as a JSON object")
    args = p.parse_args(argv)
    path, _, name = args.test.partition("::")
    first, _, last = args.seeds.partition(":")
    if not name or not path.endswith(".py"):
        p.error(f"the test {args.test!r} is not <file>.py::<function>, e.g. tests/test_fp8.py::test_refusals")
    if not (first.isdigit() and last.isdigit() and int(first) < int(last)):
        p.error(f"--seeds {args.seeds!r} is not first:last with first < last, e.g. 0:100")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        p.error(f"--kwargs {args.kwargs!r} is not a JSON object, e.g. '{{\"case\": \"plain\"}}'")
    test_file = ROOT / path
    if not test_file.is_file():
        p.error(f"no test file {path!r} (from {ROOT}); give tests/<file>.py")
    folder = test_file.parent
    sys.path.insert(0, str(folder))
    os.environ.setdefault("ULYSSES_TEST_SEED", "0")
    if (folder / "conftest.py").exists():
        importlib.import_module("conftest")  # the suite's XLA flags and 8 CPU devices, before jax starts
    test = getattr(importlib.import_module(test_file.stem), name)
    failed, start = [], time.time()
    for seed in range(int(first), int(last)):
        try:
            test(**kwargs, seed=seed)
        except AssertionError as e:
            failed.append(seed)
            print(f"seed {seed}: {(str(e).splitlines() or ['(no message)'])[0][:300]}", flush=True)
    print(json.dumps(dict(test=args.test, kwargs=kwargs, seeds=args.seeds, failed=failed,
                          seconds=round(time.time() - start))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
