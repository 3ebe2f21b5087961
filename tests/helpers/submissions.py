"""Students' submissions of chapter 11, written as a class would hand them in.

Each is the chapter as a learner opens it (``notebooks/11_write_and_grade.ipynb``)
with the learner's cells filled in: the model answers (a correct student), or
a body given here (a wrong or a cheating one), plus any cells a student
added.  Used by ``tests/cluster/test_roster.py`` and ``benchmarks/``.
"""

from __future__ import annotations

from pathlib import Path

from dpnb.core.grading import EXERCISES

REPO = Path(__file__).resolve().parents[2]
CHAPTER = REPO / "notebooks" / "11_write_and_grade.ipynb"


#: an instructor's assignment with an exercise dpnb does not have: the max over ranks,
#: point-to-point only (tests/cluster/test_roster.py, tests/unit/test_assignment.py)
WEEK3 = '''
title = "week 3"
world_size = 2
graded = ["max_allreduce"]
[exercises.max_allreduce]
kind = "tensor"
signature = "max_allreduce(t)"
statement = "The element-wise max over every rank, in place, with point-to-point calls only."
cases = [[8], [3, 5]]
reference = """
def reference(inputs, rank):
    return torch.stack(inputs).amax(0)
"""
only = ["send", "recv", "isend", "irecv"]
optimum = "all_reduce"
points = {values = 2, p2p_only = 3}
'''


def _exercise_of(src: str) -> str | None:
    """The exercise whose function a ``%%dp`` cell of the chapter asks for."""
    if not src.startswith("%%dp"):
        return None
    for key in EXERCISES:
        if f"def {key}(" in src:
            return key
    return None


def submission(path: Path, answers: dict[str, str] | None = None, *, model: bool = True,
               after: dict[str, list[str]] | None = None) -> Path:
    """Write chapter 11 to ``path`` with its exercise cells filled: ``answers[key]``
    (the cell's code, without ``%%dp``) where given, else the model answer when
    ``model``, else as the learner opens it.  ``after[key]``: code cells the
    student added right after that exercise's cell (start one with ``%%dp``
    to run it on the ranks)."""
    import nbformat

    nb = nbformat.read(CHAPTER, as_version=4)
    cells = []
    for cell in nb.cells:
        key = _exercise_of(cell.source) if cell.cell_type == "code" else None
        if key and answers and key in answers:
            cell.source = "%%dp\n" + answers[key]
        elif key and model:
            cell.source = "%%dp\n" + EXERCISES[key].answer
        cells.append(cell)
        for extra in (after or {}).get(key or "", []):
            cells.append(nbformat.v4.new_code_cell(extra))
    nb.cells = cells
    nbformat.write(nb, path)
    return path
