"""Chapter 11 graded the way a class grades a submission: ``dpnb grade
NOTEBOOK --json`` executes the notebook's cells on the grader's cluster and
writes the built-in assignment's points per check to a grade file.  A
correct student's submission is the chapter with the model answers in its
exercise cells (``helpers.submissions``); the chapter as a learner opens it
(whose functions raise NotImplementedError) scores 0 of the same total."""

from __future__ import annotations

import json

import pytest

from dpnb import cli
from dpnb.core.grading import BUILTIN
from helpers import nbutil as nbu
from helpers.submissions import submission

#: what the chapter asks a learner to write, and the built-in assignment grades
GRADED = [e.key for e in BUILTIN.roster_exercises]


@pytest.mark.timeout(600)
def test_dpnb_grade_writes_full_points_for_chapter_11_with_the_model_answers(tmp_path, capsys):
    sub = submission(tmp_path / "submission.ipynb")
    rc = cli.main(["grade", str(sub), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["error"] == "", res["error"]
    graded = {g["exercise"]: g for g in res["exercises"]}
    # every exercise the chapter has the learner write was graded once (zero2_step, the
    # ZeRO-2 variant, is not in the chapter: tests/cluster/test_grading.py grades it)
    assert list(graded) == GRADED == ["ring_allreduce", "allreduce_hook", "zero1_step"], res
    for g in graded.values():
        assert g["passed"] and g["points"] == g["max_points"] >= 2, g
        assert all(c["points"] == c["max_points"] == 1 for c in g["checks"]), g
    assert res["points"] == res["max_points"] and rc == 0
    on_disk = json.loads((tmp_path / "submission.grade.json").read_text())
    assert on_disk["points"] == res["points"] and on_disk["exercises"] == res["exercises"]


@pytest.mark.timeout(600)
def test_dpnb_grade_gives_no_point_to_the_chapter_as_a_learner_opens_it(tmp_path, capsys):
    """The same chapter without its model answers: every exercise's function
    raises NotImplementedError, so every exercise is graded and fails and no
    point is given, out of the same total -- a grader that passes everything
    fails here.  The exit code is the grader's, not the student's: 0."""
    import nbformat

    sub = tmp_path / "learner.ipynb"
    nbformat.write(nbformat.read(nbu.REPO / "notebooks" / "11_write_and_grade.ipynb", as_version=4),
                   sub)
    rc = cli.main(["grade", str(sub), "--json"])
    res = json.loads(capsys.readouterr().out)
    graded = {g["exercise"]: g for g in res["exercises"]}
    assert list(graded) == GRADED, res
    for g in graded.values():
        assert not g["passed"] and g["points"] == 0 < g["max_points"], g
        assert any("raised NotImplementedError" in c["feedback"] for c in g["checks"]), g
    assert res["points"] == 0 and res["max_points"] == BUILTIN.max_points and rc == 0, \
        (rc, res["points"])
