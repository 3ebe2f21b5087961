"""What grading a roster costs beside the grades themselves, measured in one ``dpnb grade`` run.

N submissions of chapter 11, each the chapter with the model answers in
its exercise cells (as a correct student hands it in), graded by
:func:`dpnb.session.roster.grade_roster` on one 2-rank cluster -- the same
call ``dpnb grade`` makes.  For each submission the grader records its
whole time (reading the notebook, running its cells, checking dpnb's
counters, grading, giving the namespace back) and the time of the grades
themselves (the exercises' cases); the ratio whole / grades is the
roster's overhead per submission.  The cluster's start is paid once and
reported apart.

    python benchmarks/roster.py [--submissions 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers.submissions import submission  # noqa: E402

from dpnb.core.assignment import load_assignment  # noqa: E402
from dpnb.session import roster  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submissions", type=int, default=30)
    a = ap.parse_args(argv)
    asg = load_assignment()
    with tempfile.TemporaryDirectory(prefix="dpnb-roster-") as d:
        paths = [str(submission(Path(d) / f"student{i:02d}.ipynb"))
                 for i in range(a.submissions)]
        t0 = time.monotonic()
        subs = roster.grade_roster(asg, paths)
        wall = time.monotonic() - t0
    assert all(s.points == s.max_points for s in subs), [s.to_record() for s in subs
                                                         if s.points != s.max_points][:1]
    whole = [s.seconds for s in subs]
    grades = [s.grading_seconds for s in subs]
    ratios = [w / g for w, g in zip(whole, grades)]
    print(f"{len(subs)} submissions of chapter 11 (model answers), {asg.max_points} points each,"
          f" one 2-rank cluster: {wall:.1f} s in all")
    print(f"  per submission: {statistics.median(whole) * 1000:.0f} ms whole, "
          f"{statistics.median(grades) * 1000:.0f} ms of grades (medians)")
    print(f"  whole / grades per submission: median {statistics.median(ratios):.2f}x, "
          f"max {max(ratios):.2f}x")
    print(f"  cluster start and stop, paid once: {wall - sum(whole):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
