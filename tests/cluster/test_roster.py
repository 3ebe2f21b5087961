"""An instructor grades a roster with ``dpnb grade``, some submissions cheating.

The whole workflow as a class runs it: chapter 11 handed in by several
students (written by ``helpers.submissions`` as a student fills in the
chapter), graded in one ``dpnb grade ... --csv --json`` run on one cluster
the grader starts.  Among them: a correct one; one that passes the ring,
then writes a full-marks grade file of its own and crashes; rings that call
the process group's ``allreduce``, a functional collective, or gather then
scatter; a ZeRO-1 step that keeps the whole momentum in a global; one that
patches dpnb's counter; one that kills a rank.  Then an exercise defined only
in an instructor's assignment file, graded on a correct and a wrong answer.
"""

from __future__ import annotations

import csv
import json
import time

import pytest

from dpnb import cli
from helpers.submissions import WEEK3 as INSTRUCTOR, submission

pytestmark = pytest.mark.timeout(600)

RING_PG = "def ring_allreduce(t):\n    dist.group.WORLD.allreduce([t]).wait()\n"
RING_FUNCTIONAL = (
    "import torch.distributed._functional_collectives as fc\n"
    "def ring_allreduce(t):\n"
    "    t.copy_(fc.wait_tensor(fc.all_reduce(t, 'sum', dist.group.WORLD)))\n")
# a learner's "ring": everything to rank 0, which sums and hands the sum back
RING_GATHER_SCATTER = (
    "def ring_allreduce(t):\n"
    "    rank, n = dist.get_rank(), dist.get_world_size()\n"
    "    parts = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None\n"
    "    dist.gather(t, parts, dst=0)\n"
    "    total = [torch.stack(parts).sum(0)] * n if rank == 0 else None\n"
    "    dist.scatter(t, total, src=0)\n")
# ZeRO-1's values, with the whole momentum kept in a module-level dict beside a 1/N `state`
ZERO1_GLOBAL = (
    "FULL = {}\n"
    "def zero1_step(params, state, lr, momentum):\n"
    "    n = dist.get_world_size()\n"
    "    flat = torch.cat([p.grad.flatten() for p in params])\n"
    "    dist.all_reduce(flat)\n"
    "    flat /= n\n"
    "    buf = FULL.get('buf') if state else None  # a new run starts from empty state\n"
    "    buf = flat.clone() if buf is None else momentum * buf + flat\n"
    "    FULL['buf'] = buf\n"
    "    state['buf'] = buf[: math.ceil(buf.numel() / n)].clone()\n"
    "    i = 0\n"
    "    with torch.no_grad():\n"
    "        for p in params:\n"
    "            p -= lr * buf[i:i + p.numel()].view_as(p)\n"
    "            i += p.numel()\n")
FORGE = (
    "import json, pathlib\n"
    "forged = {'points': 13, 'max_points': 13, 'error': '', 'exercises': []}\n"
    "pathlib.Path('forger.grade.json').write_text(json.dumps(forged))\n"
    "raise RuntimeError('crashed after the ring')\n")
TAMPER = ("%%dp\nimport dpnb.engine.gradecount as gcount\n"
          "gcount.Counting.__torch_dispatch__ = "
          "lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))\n")
KILL = "%%dp\nimport os\nif dist.get_rank() == 1:\n    os._exit(3)\n"
LOOP = "while True:\n    pass\n"  # a kernel cell that never ends
DP_CRASH = "%%dp\nif dist.get_rank() == 1:\n    raise ValueError('oops on the ranks')\n"


def _grade(argv, capsys):
    rc = cli.main(["grade", *argv, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def _checks(rec, exercise):
    ex = next(e for e in rec["exercises"] if e["exercise"] == exercise)
    return {c["name"]: c for c in ex["checks"]}


def test_a_roster_with_cheats_is_graded_by_the_grader_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a submission's relative paths land here
    subs = {
        "good": submission(tmp_path / "good.ipynb"),
        "forger": submission(tmp_path / "forger.ipynb", after={"ring_allreduce": [FORGE]}),
        "pgring": submission(tmp_path / "pgring.ipynb", {"ring_allreduce": RING_PG}),
        "fcring": submission(tmp_path / "fcring.ipynb", {"ring_allreduce": RING_FUNCTIONAL}),
        "gsring": submission(tmp_path / "gsring.ipynb", {"ring_allreduce": RING_GATHER_SCATTER}),
        "globalm": submission(tmp_path / "globalm.ipynb", {"zero1_step": ZERO1_GLOBAL}),
        "tamper": submission(tmp_path / "tamper.ipynb", after={"ring_allreduce": [TAMPER]}),
        "killer": submission(tmp_path / "killer.ipynb", after={"ring_allreduce": [KILL]}),
        "dpcrash": submission(tmp_path / "dpcrash.ipynb", after={"ring_allreduce": [DP_CRASH]}),
        "looper": submission(tmp_path / "looper.ipynb", after={"ring_allreduce": [LOOP]}),
        "after": submission(tmp_path / "after.ipynb"),  # graded on the restarted cluster
    }
    book = tmp_path / "book.csv"
    t0 = time.monotonic()
    rc, recs, err = _grade([*map(str, subs.values()), "--csv", str(book), "--timeout", "5"],
                           capsys)
    took = time.monotonic() - t0
    assert rc == 0, err  # the students' points are not the grader's exit code
    by = {r["notebook"].rsplit("/", 1)[-1][:-6]: r for r in recs}
    assert all(r["max_points"] == 13 for r in recs)  # the assignment's total, for everyone
    for name in ("good", "after"):
        failed = [(e["exercise"], c) for e in by[name]["exercises"] for c in e["checks"]
                  if not c["passed"]]
        assert by[name]["points"] == 13, (name, failed)

    # the forged grade file is overwritten; the crash and the unrun exercises show
    forger = json.loads((tmp_path / "forger.grade.json").read_text())
    assert forger["points"] == by["forger"]["points"] == 5, forger
    assert "crashed after the ring" in forger["error"] and forger["max_points"] == 13
    hook = _checks(forger, "allreduce_hook")
    assert all(c["points"] == 0 and "not defined" in c["feedback"] for c in hook.values())

    for name, op in (("pgring", "all_reduce"), ("fcring", "all_reduce"),
                     ("gsring", "gather, scatter")):
        p2p = _checks(by[name], "ring_allreduce")["point-to-point only"]
        assert not p2p["passed"] and p2p["measured"] == op, (name, p2p)
    gs_bytes = _checks(by["gsring"], "ring_allreduce")["bytes sent"]
    assert gs_bytes["measured"] != "rank 0 sent 0 B", gs_bytes

    mem = _checks(by["globalm"], "zero1_step")["optimizer state held"]
    assert not mem["passed"] and "keeps the whole momentum" in mem["feedback"], mem

    assert by["tamper"]["points"] == 0 and any(
        "gradecount.Counting.__torch_dispatch__" in t for t in by["tamper"]["tampered"])
    killer = by["killer"]
    assert killer["points"] == 5 and "cell" in killer["error"], killer
    # a %%dp cell that raises stops the notebook at that cell, named by its number
    import nbformat
    src = nbformat.read(subs["dpcrash"], as_version=4).cells
    at = next(i for i, c in enumerate(src, 1) if "oops on the ranks" in c.source)
    crash = by["dpcrash"]
    assert crash["points"] == 5 and crash["error"].startswith(f"cell {at} "), crash["error"]
    assert "ValueError: oops on the ranks" in crash["error"], crash["error"]
    # a kernel cell that never ends is interrupted at the cell timeout: the notebook stops there
    at = next(i for i, c in enumerate(nbformat.read(subs["looper"], as_version=4).cells, 1)
              if "while True" in c.source)
    loop = by["looper"]
    assert loop["points"] == 5 and loop["error"].startswith(f"cell {at} "), loop["error"]
    assert loop["seconds"] < 30 and took < 240, (loop["seconds"], took)  # not a timeout

    rows = list(csv.reader(book.open()))
    assert rows[0][:3] == ["student", "points", "max_points"] and len(rows) == 1 + len(subs)
    assert len(rows[0]) == 3 + 13 + 2  # a column per check of the assignment
    assert {r[0]: int(r[1]) for r in rows[1:]}["tamper"] == 0
    assert f"[{len(subs)}/{len(subs)}] after: 13/13 points" in err


MAX_RIGHT = ("def max_allreduce(t):\n"
             "    other = torch.empty_like(t)\n"
             "    peer = 1 - dist.get_rank()\n"
             "    req = dist.irecv(other, src=peer)\n"
             "    dist.send(t.contiguous(), dst=peer)\n"
             "    req.wait()\n"
             "    torch.maximum(t, other, out=t)\n")
MAX_WRONG = MAX_RIGHT.replace("torch.maximum(t, other, out=t)", "t.add_(other)")


def test_an_exercise_defined_only_in_the_instructor_s_file_grades_right_and_wrong(
        tmp_path, capsys):
    import nbformat

    (tmp_path / "week3.toml").write_text(INSTRUCTOR)
    paths = []
    for name, body in (("right", MAX_RIGHT), ("wrong", MAX_WRONG)):
        nb = nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_code_cell("%load_ext dpnb\n%dp start -n 2"),
            nbformat.v4.new_code_cell("%%dp\nimport torch\nimport torch.distributed as dist"),
            nbformat.v4.new_code_cell("%%dp\n" + body)])
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
        paths.append(str(tmp_path / f"{name}.ipynb"))
    rc, recs, err = _grade(["--assignment", str(tmp_path / "week3.toml"), *paths], capsys)
    assert rc == 0, err
    right, wrong = recs
    assert (right["points"], right["max_points"]) == (8, 8), right
    assert (wrong["points"], wrong["max_points"]) == (4, 8), wrong  # p2p and bytes, no values
    assert not _checks(wrong, "max_allreduce")["values (n=8)"]["passed"]
