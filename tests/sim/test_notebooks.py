"""The notebooks run top to bottom (so they never rot) and are committed without outputs."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# a cell that has not finished in this long has hung; how fast the notebooks run is no test's
# business (a shared machine's pace varies by 2x and more)
CELL_TIMEOUT_S = 900


def test_there_are_at_least_three_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_have_no_outputs(path):
    book = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(book.cells)
             if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; strip them (jupyter nbconvert --clear-output)"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent.parent)}}).execute()
    errors = [o for cell in book.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    figures = [o for cell in book.cells for o in cell.get("outputs", [])
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures, f"{path.name} shows no plotly figure"
