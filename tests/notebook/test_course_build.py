"""``dpnb course build``: a chapter executed and written as HTML a reader can
open without running anything (figures inline, questions without answers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import nbutil as nbu


TINY = [
    "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0]); plt.title('a figure')",
    "from dpnb.quiz import ask\nask('02.1')",
]


@pytest.mark.timeout(400)
def test_course_build_writes_an_executed_chapter(tmp_path):
    # a chapter of its own (the real ones are executed by test_execute.py)
    import nbformat

    src = tmp_path / "notebooks"
    src.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A tiny chapter")] + \
        [nbformat.v4.new_code_cell(c) for c in TINY]
    nbformat.write(nb, str(src / "02_tiny.ipynb"))
    out = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "dpnb.cli", "course", "build", str(out),
                        "--notebooks", str(src), "--only", "02"],
                       capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stdout + r.stderr
    page = (out / "02_tiny.html").read_text()
    assert "data:image/png;base64" in page  # the figure, inline
    assert "Traceback" not in page
    assert "A tiny chapter" in page and "02.1" in page  # the question is there by its id ...
    from dpnb import quiz

    for q in quiz.load("02"):
        assert not any(e[:50] in page for e in q.explanations)  # ... its explanations are not
    index = (out / "index.html").read_text()
    assert "02_tiny.html" in index and "failed" not in index


def test_course_build_rejects_an_unknown_chapter(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dpnb.cli", "course", "build", str(tmp_path),
                        "--notebooks", str(nbu.REPO / "notebooks"), "--only", "42"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no chapter 42" in r.stderr and "00, 01" in r.stderr
