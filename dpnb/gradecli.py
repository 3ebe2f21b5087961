"""``dpnb grade``: a roster graded, a grade file per submission, a gradebook CSV.

    dpnb grade [--assignment A.toml] SUBMISSION.ipynb... [--csv gradebook.csv] [--json]

Each submission is executed and graded on one cluster the grader starts
(:mod:`dpnb.session.roster`); its grade file, ``SUBMISSION.grade.json``
(``points``, ``max_points``, ``exercises``: points per check), and the CSV
are written by this process only, after the cluster has stopped.  The exit
code is 0 whatever the students scored; 2 when the grader itself could not
grade (a file missing, an assignment that does not parse, a cluster that
did not start).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    gr = sub.add_parser(
        "grade", help="grade submitted notebooks on the grader's own cluster: a grade file "
                      "per submission, a gradebook CSV; exit 0 whatever the points (2: the "
                      "grader could not grade)")
    gr.add_argument("notebooks", nargs="+", metavar="SUBMISSION", help="submitted .ipynb files")
    gr.add_argument("--assignment", default=None, metavar="FILE",
                    help="the instructor's assignment (TOML); default: dpnb's own exercises")
    gr.add_argument("--csv", default=None, metavar="FILE",
                    help="write the gradebook: one row per submission, one column per check")
    gr.add_argument("--json", action="store_true",
                    help="print the grade records as JSON (one submission: its record; "
                         "several: a list)")
    gr.add_argument("--out", default=None,
                    help="the grade file, for a single submission (default SUBMISSION.grade.json)")
    gr.add_argument("-n", type=int, default=None,
                    help="ranks to grade on (default: the assignment's world_size)")
    gr.add_argument("--timeout", type=float, default=60.0,
                    help="seconds each %%dp cell of a submission may run, and its kernel "
                         "cells together (default 60)")


def run(a) -> int:
    # lazy: the grader's modules load only for this command
    from .core.assignment import load_assignment
    from .core.errors import ConfigError
    from .core.gradebook import gradebook_rows, submission_report
    from .errors import DpnbError
    from .session.roster import grade_roster

    if a.out and len(a.notebooks) > 1:
        print("dpnb grade: --out names one grade file: give one submission, or drop --out",
              file=sys.stderr)
        return 2

    def progress(i, total, sub):
        print(f"[{i}/{total}] {sub.student}: {sub.points}/{sub.max_points} points "
              f"({sub.seconds:.1f} s)" + (f" -- stopped at {sub.stopped}" if sub.stopped else "")
              + (" -- NOT GRADED: changed dpnb's counters" if sub.tampered else ""),
              file=sys.stderr, flush=True)

    try:
        asg = load_assignment(a.assignment)
        subs = grade_roster(asg, a.notebooks, world_size=a.n, cell_timeout=a.timeout,
                            progress=progress)
    except (ConfigError, DpnbError) as e:
        print(f"dpnb grade: {e}", file=sys.stderr)
        return 2
    # written now: the cluster (where submissions ran) is stopped
    records = []
    for s in subs:
        rec = s.to_record()
        target = Path(a.out) if a.out else Path(s.path).with_suffix(".grade.json")
        target.write_text(json.dumps(rec, indent=1))
        records.append(dict(rec, grade_file=str(target)))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows(gradebook_rows(asg, subs))
    if a.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
    else:
        for s in subs:
            print(submission_report(s) + "\n")
        total = sum(s.seconds for s in subs)
        print(f"{len(subs)} submission(s) graded in {total:.1f} s"
              + (f"; gradebook: {a.csv}" if a.csv else ""))
    return 0
