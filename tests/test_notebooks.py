"""The notebooks run top to bottom (on CPU, small settings) and are committed without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_four_notebooks_without_outputs():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        code = [c for c in book.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), f"{path.name}: strip outputs"
        assert book.cells[0].cell_type == "markdown" and book.cells[-1].cell_type == "markdown"
        assert "What to try next" in book.cells[-1].source
        # notebooks drive the package; they define no logic of their own beyond small helpers
        assert any("vision_attn" in c.source for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, monkeypatch):
    monkeypatch.setenv("VISION_ATTN_NOTEBOOK_QUICK", "1")  # the kernel inherits it: less data, one epoch
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the notebook draws its figures"
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
