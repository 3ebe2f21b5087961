"""papermill as a second client: every chapter has a cell tagged
``parameters``, and ``papermill 09_summary.ipynb out.ipynb -p STRATEGY zero3``
really trains with zero3 (it silently ran ddp before the cell was tagged)."""

from __future__ import annotations

import json

import pytest

from helpers import nbutil as nbu


def test_every_chapter_has_a_parameters_cell_with_the_world_size():
    for path in nbu.notebooks():
        nb = json.loads(path.read_text())
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged parameters"
        src = "".join(tagged[0]["source"])
        assert "WORLD_SIZE = 2" in src, path.name
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert "%dp start -n $WORLD_SIZE" in code, path.name


@pytest.mark.timeout(600)
def test_papermill_runs_the_summary_with_zero3(tmp_path):
    pm = pytest.importorskip("papermill")
    src = nbu.REPO / "notebooks" / "09_summary.ipynb"
    out = tmp_path / "out.ipynb"
    pm.execute_notebook(str(src), str(out), parameters={"STRATEGY": "zero3"},
                        cwd=str(src.parent), progress_bar=False, log_output=False,
                        kernel_name="python3")
    import nbformat

    nb = nbformat.read(out, as_version=4)  # sources and outputs as strings
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and 'STRATEGY = "zero3"' in injected[0].source
    wrap = next(c for c in nb.cells if c.source.startswith("%dp wrap net"))
    text = "".join(o.get("text", "") for o in wrap.outputs)
    assert "wrapped with zero3" in text, text
    assert "wrapped with ddp" not in out.read_text()
