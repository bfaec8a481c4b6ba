"""Execute the notebooks, so they cannot rot: as a new user's fresh kernel runs them (no JAX variable of the test
setup), with no error and no traceback in any cell's output; the stored outputs hold none either."""

import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# Notebooks whose first code cell starts with "# parameters" run here with these settings instead (their
# committed outputs come from the full settings).
PARAMETERS = {
    "03_plan_a_cluster_run": 'PRESET = "tiny"\nDEVICE_COUNTS = (1, 8)\nLENGTHS = [2048, 8192]\n'
                             'CHUNK = 256\nATTENTION = "xla"\nMAX_COMPILES = 8\n',
    "04_did_the_long_context_take": "STEPS = 3\nSEQ_LEN = 256\nSAMPLES = 1\n",
}
NEEDS_AOT = {"03_plan_a_cluster_run"}  # compiles for compile-only H100s: needs the CUDA plugin


def _case(path):
    marks = [pytest.mark.aot] if path.stem in NEEDS_AOT else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [_case(p) for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    if path.stem in PARAMETERS:
        cell = next(c for c in nb.cells if c.cell_type == "code")
        assert cell.source.startswith("# parameters"), "the first code cell must be the parameters cell"
        cell.source = "# parameters (test)\n" + PARAMETERS[path.stem]
    # the kernel's environment is a user's: without conftest's JAX_SKIP_CUDA_CONSTRAINTS_CHECK and XLA_FLAGS, so a
    # notebook that does not set JAX_PLATFORMS before JAX starts shows the CUDA plugin's start-up traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    assert not _tracebacks(nb), _tracebacks(nb)[0][:2000]


def _tracebacks(nb) -> list[str]:
    """Every code cell output that is an error or whose text holds a traceback (a warning printed by a library)."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else ():
            text = out.get("text", "") or "".join(str(v) for v in out.get("data", {}).values())
            if out.output_type == "error":
                found.append(f"{out.get('ename')}: {out.get('evalue')}")
            elif "Traceback (most recent call last)" in text:
                found.append(text)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_is_clean(path):
    """The committed outputs hold no traceback, and JAX_PLATFORMS is set before the first import of JAX."""
    nb = nbformat.read(path, as_version=4)
    assert not _tracebacks(nb), _tracebacks(nb)[0][:2000]
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    first_import = re.search(r"^(import jax|from jax|import ulysses_jax|from ulysses_jax)", code, re.M)
    platforms = re.search(r"JAX_PLATFORMS", code)
    assert first_import and platforms and platforms.start() < first_import.start(), \
        "set os.environ['JAX_PLATFORMS'] before JAX is imported"
