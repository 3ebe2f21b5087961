"""An instructor's assignment file read, refused in one line when wrong, and
counted the same for every submission; the gradebook's rows."""

from __future__ import annotations

import pytest

from dpnb.core import grading as g
from dpnb.core.assignment import load_assignment, parse_assignment, planned_checks
from dpnb.core.errors import ConfigError
from dpnb.core.gradebook import SubmissionGrade, gradebook_rows
from helpers.submissions import WEEK3

# the roster test's assignment, at 4 ranks, with a hint of its own
TREE = (WEEK3.replace("world_size = 2", "world_size = 4")
        .replace('title = "week 3"', 'title = "CS-DP week 3"')
        + '[exercises.max_allreduce.hints]\nvalues = ["max, not sum"]\n')


def test_an_instructor_defines_an_exercise_with_its_own_points_and_hints():
    a = parse_assignment(TREE, "week3.toml")
    ex = a.exercise("max_allreduce")
    assert (a.title, a.world_size, ex.kind, ex.only) == (
        "CS-DP week 3", 4, "tensor", ("send", "recv", "isend", "irecv"))
    checks = planned_checks(ex)
    assert [(c.name, c.points) for c in checks] == [
        ("values (n=8)", 2), ("values (case 2)", 2), ("point-to-point only", 3), ("bytes sent", 1)]
    assert a.max_points == 8 and ex.hints_for("values") == ("max, not sum",)
    assert ex.answer == "" and not a.reveal_answers  # a class: no answer unless given


@pytest.mark.parametrize("change, words", [
    (("kind = \"tensor\"", "kind = \"ring\""), "kind 'ring' is not one of tensor"),
    (("only = [", "only = [\"all_reducee\", "), "only names all_reducee"),
    (("points = {values = 2", "points = {speed = 2"), "points for speed"),
    (("def reference(inputs, rank):", "def ref(inputs, rank):"), "needs reference ="),
    (("cases = [[8], [3, 5]]", "kases = [[8]]"), "unknown field(s) kases"),
    (("world_size = 4", "world_size = 1"), "world_size 1 must be"),
    (("title =", "titel ="), "unknown top-level key(s) titel"),
])
def test_a_wrong_assignment_is_refused_in_one_line_saying_what_to_do(change, words):
    with pytest.raises(ConfigError) as e:
        parse_assignment(TREE.replace(*change), "week3.toml")
    assert words in str(e.value) and "\n" not in str(e.value) and "week3.toml" in str(e.value)


def test_the_builtin_assignment_is_a_file_like_any_instructor_s(tmp_path):
    """dpnb's own exercises read from package data; an answer file beside an
    instructor's assignment is read from there (not from dpnb)."""
    b = load_assignment()
    assert [e.key for e in b.roster_exercises] == ["ring_allreduce", "allreduce_hook", "zero1_step"]
    assert b.reveal_answers and all("def " in e.answer for e in b.exercises)
    (tmp_path / "ans.py").write_text("def max_allreduce(t):\n    pass\n")
    (tmp_path / "a.toml").write_text(TREE.replace('optimum = "all_reduce"',
                                                  'optimum = "all_reduce"\nanswer_file = "ans.py"'))
    assert "def max_allreduce" in load_assignment(str(tmp_path / "a.toml")).exercises[0].answer
    with pytest.raises(ConfigError, match="no assignment file at"):
        load_assignment(str(tmp_path / "missing.toml"))


def test_the_gradebook_has_a_column_per_check_and_a_row_per_student():
    a = parse_assignment(TREE, "week3.toml")
    ex = a.exercise("max_allreduce")
    ok = g.make_grade(ex, ex.key, 4, [g.Check(c.name, True, "ok", "ok") for c in planned_checks(ex)],
                      tries=1)
    crashed = g.make_grade(ex, ex.key, 4, [], tries=1, why_missing="not defined")
    rows = gradebook_rows(a, [SubmissionGrade("sub/ann.ipynb", (ok,), a.max_points),
                              SubmissionGrade("sub/bob.ipynb", (crashed,), a.max_points,
                                              stopped="cell 3: NameError"),
                              SubmissionGrade("sub/eve.ipynb", (ok,), a.max_points,
                                              tampered=("dpnb.engine.gradecount.Counting",))])
    assert rows[0][:4] == ["student", "points", "max_points", "max_allreduce: values (n=8)"]
    assert [r[:3] for r in rows[1:]] == [["ann", 8, 8], ["bob", 0, 8], ["eve", 0, 8]]
    assert rows[1][3:7] == [2, 2, 3, 1] and rows[3][3:7] == [0, 0, 0, 0]
    assert rows[2][-1] == "cell 3: NameError" and rows[3][-1].startswith("tampered: dpnb.engine")
