"""Execute the notebooks, so they cannot rot."""

import pathlib

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
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors[0].get("evalue")
