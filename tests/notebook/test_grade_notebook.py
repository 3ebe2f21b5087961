"""Chapter 11 headless with its model answers, graded the way a class grades a
submission: ``dpnb grade NOTEBOOK --json`` executes the notebook and writes
every ``%dp grade`` in it, points per check, to a grade file.  The papermill
parameter ``MODEL_ANSWERS`` is what a course run sets; the learner's cells
(which raise NotImplementedError) are run as they stand -- ``test_execute``
runs the chapter as a learner opens it."""

from __future__ import annotations

import json

import pytest

from dpnb import cli
from dpnb.core.grading import EXERCISES
from helpers import nbutil as nbu


@pytest.mark.timeout(600)
def test_dpnb_grade_writes_full_points_for_chapter_11_with_the_model_answers(tmp_path, capsys):
    pm = pytest.importorskip("papermill")
    import nbformat

    src = nbu.REPO / "notebooks" / "11_write_and_grade.ipynb"
    sub = tmp_path / "submission.ipynb"
    # papermill's reader (it gives every cell a tags list), then its parameter injection
    nb = pm.parameterize.parameterize_notebook(pm.iorw.load_notebook_node(str(src)),
                                               {"MODEL_ANSWERS": True}, kernel_name="python3")
    nbformat.write(nb, sub)
    rc = cli.main(["grade", str(sub), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["error"] == "", res["error"]
    graded = {g["exercise"]: g for g in res["exercises"]}
    # every exercise the chapter has the learner write was graded once (zero2_step, the
    # ZeRO-2 variant, is not in the chapter: tests/cluster/test_grading.py grades it)
    assert sorted(graded) == sorted(set(EXERCISES) - {"zero2_step"}), res
    for g in graded.values():
        assert g["passed"] and g["points"] == g["max_points"] >= 2, g
        assert all(c["points"] == c["max_points"] == 1 for c in g["checks"]), g
    assert res["points"] == res["max_points"] and rc == 0
    on_disk = json.loads((tmp_path / "submission.grade.json").read_text())
    assert on_disk["points"] == res["points"] and on_disk["exercises"] == res["exercises"]


@pytest.mark.timeout(600)
def test_dpnb_grade_gives_no_point_to_the_chapter_as_a_learner_opens_it(tmp_path, capsys):
    """The same chapter without its model answers: every exercise's function
    raises NotImplementedError, so every exercise is graded and fails, no point
    is given, and ``dpnb grade`` says so by its exit code -- a grader that
    passes everything fails here."""
    import nbformat

    sub = tmp_path / "learner.ipynb"
    nbformat.write(nbformat.read(nbu.REPO / "notebooks" / "11_write_and_grade.ipynb", as_version=4),
                   sub)
    rc = cli.main(["grade", str(sub), "--json"])
    res = json.loads(capsys.readouterr().out)
    graded = {g["exercise"]: g for g in res["exercises"]}
    assert sorted(graded) == sorted(set(EXERCISES) - {"zero2_step"}), res
    for g in graded.values():
        assert not g["passed"] and g["points"] == 0 < g["max_points"], g
        assert any("raised NotImplementedError" in c["feedback"] for c in g["checks"]), g
    assert res["points"] == 0 < res["max_points"] and rc == 1, (rc, res["points"])
