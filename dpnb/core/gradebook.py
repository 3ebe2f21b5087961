"""A roster's grades: one record per submission, and the gradebook's rows (pure).

:mod:`dpnb.session.roster` grades each submission on the grader's own
cluster and makes one :class:`SubmissionGrade`; this module says what it
holds, how it reads to the student (:func:`submission_report`) and how a
class reads in a spreadsheet (:func:`gradebook_rows`: one row per student,
one column per check, every check of the assignment in every row).
"""

from __future__ import annotations

from dataclasses import dataclass

from .assignment import Assignment, planned_checks
from .grading import Grade


@dataclass(frozen=True)
class SubmissionGrade:
    """One submission graded: a grade per exercise of the assignment, in its order."""

    path: str
    grades: tuple[Grade, ...]
    max_points: int
    stopped: str = ""  # the cell that stopped the notebook, and why ("" when every cell ran)
    tampered: tuple[str, ...] = ()  # what the submission changed in dpnb or torch.distributed
    seconds: float = 0.0
    grading_seconds: float = 0.0  # of which the exercises' cases

    @property
    def points(self) -> int:
        return 0 if self.tampered else sum(g.points[0] for g in self.grades)

    @property
    def student(self) -> str:
        name = self.path.rsplit("/", 1)[-1]
        return name[:-6] if name.endswith(".ipynb") else name

    def to_record(self) -> dict:
        return {"notebook": self.path, "points": self.points, "max_points": self.max_points,
                "error": self.stopped, "tampered": list(self.tampered),
                "seconds": round(self.seconds, 3), "grading_seconds": round(self.grading_seconds, 3),
                "exercises": [g.to_record() for g in self.grades]}


def submission_report(s: SubmissionGrade) -> str:
    """The submission's grade in a learner's words: points, then each exercise's report."""
    lines = [f"{s.student}: {s.points}/{s.max_points} points"]
    if s.tampered:
        lines.append("NOT GRADED: the notebook changed what the grader measures with ("
                     + ", ".join(s.tampered[:5]) + ("..." if len(s.tampered) > 5 else "")
                     + "); every exercise scores 0.")
    if s.stopped:
        lines.append(f"The notebook stopped early: {s.stopped}; the exercises are graded for "
                     "what it had defined by then.")
    for g in s.grades:
        lines += ["", g.report]
    return "\n".join(lines)


def gradebook_columns(a: Assignment) -> list[str]:
    """``exercise: check`` for every check the assignment plans, in order."""
    return [f"{e.key}: {c.name}" for e in a.roster_exercises for c in planned_checks(e)]


def gradebook_rows(a: Assignment, subs: list[SubmissionGrade]) -> list[list]:
    """The header, then one row per submission: student, points, max, each check's points, note."""
    cols = gradebook_columns(a)
    rows: list[list] = [["student", "points", "max_points", *cols, "seconds", "note"]]
    for s in subs:
        got = {f"{g.exercise}: {c.name}": (0 if s.tampered or not c.passed else c.points)
               for g in s.grades for c in g.checks}
        note = "; ".join(x for x in (("tampered: " + ", ".join(s.tampered[:3])) if s.tampered
                                     else "", s.stopped) if x)
        rows.append([s.student, s.points, s.max_points, *(got.get(c, 0) for c in cols),
                     round(s.seconds, 2), note])
    return rows
