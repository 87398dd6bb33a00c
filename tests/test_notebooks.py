"""Every notebook executes top to bottom in a real Jupyter kernel, in quick mode, in order."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "notebooks").glob("[A-Z]_*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_quick(path, quick_env, monkeypatch):
    for key, value in quick_env.items():  # the kernel inherits this process's environment
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the failing cell and traceback, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # nbgrader's autograder gives a tests cell no points when it writes to stderr (a warning, a progress bar)
    noisy = [c.source.split("\n")[0] for c in nb.cells if "tests" in c.metadata.get("tags", [])
             for o in c.get("outputs", []) if o.output_type == "stream" and o.name == "stderr"]
    assert not noisy, f"tests cells that write to stderr, which nbgrader scores 0: {noisy}"
