"""``dpnb grade``: a roster of submitted notebooks graded on the grader's own cluster.

Grades are computed outside any student's kernel.  The grader starts one
cluster and, for each submission in turn (:func:`grade_roster`):

1. keeps the ranks' namespace as it is (:func:`dpnb.engine.gradesandbox.begin`);
2. executes the notebook's cells in order, as a kernel would: a ``%%dp`` cell
   on every rank (its options ``-r`` and ``--timeout`` honoured), any other
   code cell on rank 0 in a kernel namespace of its own, dpnb's magics in it
   (``%dp start``, ``%dp grade`` ...) left to the grader.  The first cell
   that fails stops the notebook, as nbclient stops; what it had defined by
   then is graded, and the report says where it stopped;
3. checks the submission left dpnb's counters and torch.distributed alone
   (:func:`dpnb.engine.gradesandbox.intact`), grades every exercise of the
   assignment with the same cases and checks as ``%dp grade``
   (:func:`dpnb.session.grading.grade_cases`), a missing function scoring 0
   with the reason, then checks again;
4. gives the namespace back (:func:`dpnb.engine.gradesandbox.end`), and
   restarts the cluster when the submission broke it (a rank died, the group
   did not re-form, a guarded binding changed).

Points exist only in this process: nothing a submission's cells do --
write files, set environment variables, patch dpnb in a kernel -- reaches
them, and the files are written only after the cluster is stopped.  The
student's own notebook and kernel are never run, so one cluster start is
paid for the whole roster.
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass

from ..core import grading as core
from ..core.assignment import Assignment, Exercise
from ..core.errors import ConfigError
from ..core.gradebook import SubmissionGrade
from ..errors import DpnbError
from dpnb.engine import entrypoints as ep
from .grading import CASE_TIMEOUT_S, grade_cases, outcomes_of

log = logging.getLogger(__name__)

#: seconds one cell of a submission may run before it is interrupted
CELL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Cell:
    """One code cell of a submission: where it runs, what it runs."""

    index: int  # the cell's number in the notebook, from 1
    on_ranks: bool  # a %%dp cell (every rank, or ``ranks``); else the kernel's
    code: str
    ranks: tuple[int, ...] | None = None
    timeout: float | None = None


def read_cells(path: str) -> list[Cell]:
    """The code cells of the notebook at ``path``, in order, typed."""
    import nbformat  # lazy: the grader's only

    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise ConfigError(f"no notebook at {path}: give the submitted .ipynb files") from None
    except Exception as e:  # nbformat raises several kinds for a broken file  # noqa: BLE001
        raise ConfigError(f"{path} is not a notebook nbformat can read ({e})") from None
    out = []
    for i, c in enumerate(nb.cells, 1):
        if c.cell_type != "code" or not c.source.strip():
            continue
        first, _, body = c.source.lstrip().partition("\n")
        if first.startswith("%%dp"):
            ranks, timeout = _dp_options(first[4:])
            out.append(Cell(i, True, body, ranks, timeout))
        else:
            out.append(Cell(i, False, c.source))
    return out


def _dp_options(line: str) -> tuple[tuple[int, ...] | None, float | None]:
    """``-r 0,1`` / ``--ranks`` and ``--timeout S`` of a ``%%dp`` line; others ignored."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None, None
    ranks = timeout = None
    for flag, val in zip(words, words[1:] + [""]):
        try:
            if flag in ("-r", "--ranks"):
                ranks = tuple(int(x) for x in val.split(",") if x.strip())
            elif flag == "--timeout":
                timeout = float(val)
        except ValueError:
            log.info("grading: %%%%dp option %s %s not read", flag, val)
    return ranks, timeout


def _why_failed(res, cell: Cell, limit: float) -> str:
    """Where the notebook stopped and why, in one sentence (the rank's own error)."""
    where = "a %%dp cell" if cell.on_ranks else "a kernel cell"
    cause = core.failure_cause(outcomes_of(res), limit)
    return f"cell {cell.index} ({where}): {cause.split(' (the other ranks')[0].rstrip('.')}"


def _magics_only(code: str) -> bool:
    """A cell of nothing but magics and shell lines: the grader's to run, so nothing to send."""
    lines = [ln.strip() for ln in code.splitlines()]
    return all(not ln or ln.startswith(("%", "!", "#")) for ln in lines)


def run_cells(c, cells: list[Cell], cell_timeout: float,
              merge: bool = True) -> tuple[str | None, int]:
    """The submission's cells as a kernel runs them, stopping at the first that
    fails: ('', len(cells)) if all ran, else where and why, and how many cells
    came before it; (None, -1) when ``%%dp`` cells run together (``merge``)
    failed and which one is not known: the caller starts the submission again
    with ``merge=False``.

    The kernel cells share nothing with the ranks' namespace (they run in their
    own on rank 0, and the magics that would link them, ``%dp push`` and the
    like, are the grader's), so they all go first, in order, in one round trip;
    the ``%%dp`` cells then run, each on its ranks, up to the first kernel cell
    that failed.  Only a side effect outside Python (a file a kernel cell
    writes and a ``%%dp`` cell reads) can see the difference."""
    kernel = [x for x in cells if not x.on_ranks and not _magics_only(x.code)]
    kfail, stop = None, len(cells)
    if kernel:
        limit = cell_timeout  # the kernel cells together: a hang costs one cell's time
        res = c.call(ep.GRADE_KERNEL_CELLS, [(x.index, x.code) for x in kernel], ranks=[0],
                     timeout=limit, raise_errors=False)
        if not res.ok:  # a kernel cell ran too long (or the engine broke): which one
            at = c.call(ep.GRADE_KERNEL_AT, ranks=[0], raise_errors=False)
            index = (at.values[0] if at.ok else None) or kernel[0].index
            kfail = {"cell": index, "why": _why_failed(res, _cell(cells, index), limit)}
        elif res.values[0]:
            f = res.values[0]
            what = f"{f['ename']}: {f['evalue']}".rstrip(": ")
            kfail = {"cell": f["cell"], "why": f"cell {f['cell']} (a kernel cell): raised {what}"}
        if kfail:
            stop = cells.index(_cell(cells, kfail["cell"]))
    for group in _dp_groups(cells[:stop], merge):
        first = group[0]
        # one cell's limit for the group: a hang costs that much, and a group that is
        # merely slow runs again cell by cell, each with its own
        limit = max(x.timeout or cell_timeout for x in group)
        code = "\n".join(x.code for x in group)
        try:
            res = c.run(code, first.ranks, timeout=limit, display=False,
                        raise_errors=False, history=False)
        except DpnbError as e:  # the cluster refuses: a rank this submission killed, found late
            log.info("grading: cell %d refused: %s", first.index, e)
            return f"cell {first.index}: {str(e).splitlines()[0]}", cells.index(first)
        if not res.ok:
            if len(group) > 1:
                return None, -1  # which of them failed: the caller runs them one by one
            return _why_failed(res, first, limit), cells.index(first)
    return (kfail["why"], stop) if kfail else ("", len(cells))


def _dp_groups(cells: list[Cell], merge: bool = True) -> list[list[Cell]]:
    """The ``%%dp`` cells in order; with ``merge``, consecutive ones on the same
    ranks in one run (one round trip; an exception stops the run where it would
    stop the notebook).  A body that starts with a cell magic runs alone
    (IPython reads it per cell)."""
    out: list[list[Cell]] = []
    for cell in cells:
        if not cell.on_ranks:
            continue
        if not merge:
            out.append([cell])
            continue
        alone = cell.code.lstrip().startswith("%%")
        if out and not alone and out[-1][-1].ranks == cell.ranks \
                and not out[-1][-1].code.lstrip().startswith("%%"):
            out[-1].append(cell)
        else:
            out.append([cell])
    return out


def _cell(cells: list[Cell], index: int) -> Cell:
    return next(x for x in cells if x.index == index)


def _roster_grade(c, ex: Exercise, checks: list[core.Check], why: str) -> core.Grade:
    """A roster's grade of ``ex``: one try, no practice footer; ``why`` the checks not made."""
    return core.make_grade(ex, ex.key, c.world_size, checks, tries=1, why_missing=why,
                           practice=False)


def grade_exercise(c, ex: Exercise, timeout: float, stopped: str, missing: list[int]) -> core.Grade:
    """``ex`` graded on ``c``: every planned check; 0 with the reason when the
    function is ``missing`` on some rank."""
    if missing:
        why = (f"{ex.key} is not defined" + (f" (the notebook stopped at {stopped})"
                                             if stopped else "") + f": expected {ex.signature}.")
        return _roster_grade(c, ex, [], why)
    return _roster_grade(c, ex, *grade_cases(c, ex, ex.key, timeout))


def _healthy(c, *, ask: bool = False) -> bool:
    """Every rank alive and the group formed, as the cluster last saw it; ``ask``:
    and every rank answers now (a round trip)."""
    if c.dead or not c.group_ok:
        return False
    if not ask:
        return True
    try:
        return c.call(ep.HAS_NAMES, [], timeout=30, raise_errors=False).ok
    except DpnbError as e:  # a cluster too broken to answer is not healthy
        log.info("grading: the cluster did not answer its health check: %s", e)
        return False


def grade_one(c, a: Assignment, path: str, *, cell_timeout: float = CELL_TIMEOUT_S,
              case_timeout: float = CASE_TIMEOUT_S, fresh=None, begun: bool = False,
              again: bool = False) -> tuple[SubmissionGrade, bool, object]:
    """One submission graded on ``c``: its grade, whether the cluster must be
    restarted after it, and the cluster it was graded on.  A cell that broke the
    cluster (a rank killed) stops the notebook there; with ``fresh`` (a function
    giving a new cluster) the cells before it are run again on a fresh one and
    what they defined is graded, as for any notebook that stopped early.
    ``begun``: the ranks already kept their namespace (the last submission's
    end did, with ``again``: one round trip less per submission)."""
    t0 = time.monotonic()
    cells = read_cells(path)
    if not begun:
        c.call(ep.GRADE_BEGIN)
    stopped, ran = run_cells(c, cells, cell_timeout)
    if stopped is None:  # a failure among cells run together: again, one cell at a time
        if _healthy(c, ask=True):
            c.call(ep.GRADE_END, True)  # the namespace as before the submission, kept again
        elif fresh is not None:
            c = fresh(c)
            c.call(ep.GRADE_BEGIN)
        stopped, ran = run_cells(c, cells, cell_timeout, merge=False)
    if stopped and fresh is not None and not _healthy(c, ask=True):
        log.info("grading %s: %s; its first %d cells again on a fresh cluster", path, stopped, ran)
        c = fresh(c)
        c.call(ep.GRADE_BEGIN)
        rerun, _ = run_cells(c, cells[:ran], cell_timeout)
        stopped = stopped + (f"; run again without it: {rerun}" if rerun else "")
    grades = []
    keys = [ex.key for ex in a.roster_exercises]
    absent: dict[str, list[int]] = {k: [] for k in keys}
    tampered: list[str] = []
    if _healthy(c):  # what the cells changed, and which functions each rank lacks: one trip
        for r, (changed, miss) in enumerate(c.call(ep.GRADE_READY, keys).values):
            tampered += changed
            for k in miss:
                absent[k].append(r)
        tampered = sorted(set(tampered))
    t1 = time.monotonic()  # the grades themselves: the exercises' cases and checks
    for ex in a.roster_exercises:
        why = ("not graded: the notebook changed dpnb's counters." if tampered else
               "" if _healthy(c) else "not run: the submission broke the cluster.")
        try:
            g = grade_exercise(c, ex, case_timeout, stopped, absent[ex.key]) if not why else None
        except DpnbError as e:  # a rank died under the case: the cluster is restarted after
            log.info("grading %s: %s broke the cluster: %s", path, ex.key, e)
            why, g = f"not run: the cluster broke ({str(e).splitlines()[0]}).", None
        grades.append(g or _roster_grade(c, ex, [], why))
    graded_s = time.monotonic() - t1
    healthy = _healthy(c, ask=True)
    if healthy:
        # the namespace given back, and a patch made while a function was graded found
        res = c.call(ep.GRADE_END, again, raise_errors=False)
        tampered = sorted(set(tampered) | {x for per in (res.values or []) if per for x in per})
        healthy = res.ok
    restart = bool(tampered) or not healthy
    sub = SubmissionGrade(path, tuple(grades), a.max_points, stopped, tuple(tampered),
                          time.monotonic() - t0, graded_s)
    return sub, restart, c


def grade_roster(a: Assignment, paths: list[str], *, world_size: int | None = None,
                 cell_timeout: float = CELL_TIMEOUT_S, case_timeout: float = CASE_TIMEOUT_S,
                 progress=None) -> list[SubmissionGrade]:
    """Every submission in ``paths`` graded on one cluster of ``world_size`` ranks
    (the assignment's by default), restarted when a submission broke it.
    ``progress(i, total, sub)`` after each.  The cluster is stopped before
    this returns."""
    from . import Cluster  # lazy: the session package imports this module

    for p in paths:
        read_cells(p)  # every file readable before the cluster starts: a typo costs a second
    n = world_size or a.world_size
    c = Cluster.start(n)
    out: list[SubmissionGrade] = []

    def fresh(old):
        nonlocal c
        old.stop()
        c = Cluster.start(n)
        return c

    begun = False
    try:
        for i, p in enumerate(paths, 1):
            sub, restart, c = grade_one(c, a, p, cell_timeout=cell_timeout,
                                        case_timeout=case_timeout, fresh=fresh, begun=begun,
                                        again=i < len(paths))
            begun = i < len(paths) and not restart
            out.append(sub)
            if progress is not None:
                progress(i, len(paths), sub)
            if restart and i < len(paths):
                log.info("grading: %s broke the cluster (%s); starting a fresh one", p,
                         ", ".join(sub.tampered) or sub.stopped or "unhealthy")
                c.stop()
                c = Cluster.start(n)
    finally:
        c.stop()
    return out
