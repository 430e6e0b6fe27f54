"""The notebooks run top to bottom (on CPU, small settings) and are committed without outputs.

The four share one kernel (its start-up, torch and Lightning imported, is most of a small
notebook's time); each starts from an empty namespace (``%reset -f``) in a folder of its own, so a
notebook that forgets an import or a definition still fails."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.util import run_sync

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


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    """A Python kernel for the notebooks of this module, shut down after the last."""
    km = AsyncKernelManager(kernel_name="python3")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VISION_ATTN_NOTEBOOK_QUICK", "1")  # the kernel inherits it: less data, one epoch
        run_sync(km.start_kernel)(cwd=str(tmp_path_factory.mktemp("kernel")))
    try:
        yield km
    finally:
        run_sync(km.shutdown_kernel)(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, kernel):
    book = nbformat.read(path, as_version=4)
    # an empty namespace and a folder of its own, as in a kernel started for this notebook alone
    book.cells.insert(0, nbformat.v4.new_code_cell(f"%reset -f\n%cd {tmp_path}"))
    client = NotebookClient(book, km=kernel, timeout=600)
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError with the failing cell and its traceback
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the notebook draws its figures"
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
