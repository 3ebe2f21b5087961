"""Every chapter follows the course's conventions (issue 16, point 4): it opens
with what the learner will see, asks for at least one prediction before a
run, keeps its prose near 1,000 words, and has no warning filters in its
cells."""

import json
import re

import pytest

from helpers.nbutil import REPO

CHAPTERS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_WORDS = 1080  # "about 1,000": tables of numbers and displayed math are not prose


def _cells(path):
    return json.loads(path.read_text())["cells"]


def prose_words(path) -> int:
    n = 0
    for c in _cells(path):
        if c["cell_type"] != "markdown":
            continue
        text = re.sub(r"\$\$.*?\$\$", " ", "".join(c["source"]), flags=re.S)
        lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("|")]
        n += len(re.findall(r"[A-Za-z][A-Za-z0-9']*", "\n".join(lines)))
    return n


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_conventions(path):
    cells = _cells(path)
    first = "".join(cells[0]["source"])
    assert cells[0]["cell_type"] == "markdown" and "**What you will see" in first, \
        "the first cell must say what the learner will see"
    predicts = [i for i, c in enumerate(cells)
                if c["cell_type"] == "markdown" and "**Predict" in "".join(c["source"])]
    assert predicts, "no predict-then-run exercise (a markdown cell with **Predict ...**)"
    # a prediction is asked before something runs that answers it
    assert any(c["cell_type"] == "code" for i in predicts for c in cells[i + 1:i + 3]), predicts
    assert prose_words(path) <= MAX_WORDS, f"{prose_words(path)} words of prose"
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "filterwarnings" not in code and "import warnings" not in code
