"""The notebooks run top to bottom in a fresh kernel, and are committed small, with outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("inspect_episodes.ipynb", "training_with_arrowbuf.ipynb")


def _outputs(notebook, output_type: str) -> list:
    return [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
            if o.output_type == output_type]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_without_errors_or_warnings(name, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not _outputs(notebook, "error")
    stderr = [o.text for o in _outputs(notebook, "stream") if o.name == "stderr"]
    assert not stderr, f"{name} wrote to stderr: {stderr}"
    assert any("image/png" in o.data for o in _outputs(notebook, "execute_result"))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_executed_with_small_outputs(name):
    path = NOTEBOOKS / name
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert not _outputs(notebook, "error")
    assert path.stat().st_size < 1_000_000
