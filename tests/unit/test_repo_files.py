"""Instant checks of committed files: notebooks saved clean, Binder files in place."""

from __future__ import annotations

import os

import pytest

from helpers import nbutil as nbu

NOTEBOOKS = nbu.notebooks()
BINDER = nbu.REPO / "binder"


def test_there_are_notebooks():
    assert any(p.name == "00_quickstart.ipynb" for p in NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state; clear it"
    # the default kernel: it exists right after `pip install` (the notebook
    # loads dpnb itself); see test_quiz.py for the first cell
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", \
        f"{path.name}: set the kernel to 'Python 3 (ipykernel)'"


def test_binder_files_are_there():
    assert (BINDER / "requirements.txt").is_file() and (BINDER / "postBuild").is_file()
    assert os.access(BINDER / "postBuild", os.X_OK), "binder/postBuild must be executable"
    req = (BINDER / "requirements.txt").read_text()
    pins = (nbu.REPO / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0+cpu" in req and "torch==2.13.0" in pins, \
        "binder/requirements.txt and constraints-cpu.txt pin different torch versions"
