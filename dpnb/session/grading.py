"""``%dp grade EXERCISE NAME``: the learner's function run on every rank, case by case.

For each case of the exercise (an assignment's: dpnb's own,
``dpnb/assignments/builtin.toml``, unless an instructor's is given) the
notebook calls :func:`dpnb.engine.grading.run_case` on every rank at once,
with a short timeout: a case that deadlocks or loops is interrupted and its
group released by the same wait that releases a ``%%dp --timeout`` cell
(:mod:`dpnb.cluster.waiting`), and the group re-formed; an exception on one
rank releases the others.  Either way the grade fails naming the cause, and
the engines live on.  What the ranks measured becomes checks
(:mod:`dpnb.core.grading`), every check the exercise plans counted (one not
made scores 0, saying why); the hints are the first failing check's own and
grow with each failed try of the same function; the model answer shows after
a pass or with ``reveal``.  Submitted notebooks are graded outside any
student's kernel by :mod:`dpnb.session.roster` (``dpnb grade``).
"""

from __future__ import annotations

import logging

from ..core import grading as core
from ..core.assignment import Assignment, Exercise
from ..core.errors import ConfigError
from dpnb.engine import entrypoints as ep

log = logging.getLogger(__name__)

#: seconds one case may run on the ranks before it is called a deadlock or a loop
#: (the cases are small: a correct answer takes milliseconds)
CASE_TIMEOUT_S = 8.0


def model_answer(key: str) -> str:
    """A built-in exercise's model answer, from package data (never in a notebook)."""
    return core.exercise(key).answer


def use_model_answer(c, key: str) -> None:
    """Define the exercise's model answer on every rank (a headless run of
    chapter 11 with ``-p MODEL_ANSWERS True``; the answer stays out of the notebook)."""
    c.run(model_answer(key), display=False, history=False)


def _where_text(a: dict | None) -> str:
    c = (a or {}).get("collective") or {}
    if not c:
        return ""
    peer = f" with rank {c['peer']}" if c.get("peer") is not None else ""
    line = (a or {}).get("user_line")
    return f"{c.get('op', '?')}{peer}" + (f" at {line}" if line else "")


def outcomes_of(res) -> list[dict]:
    """The failed case's per-rank outcomes as :func:`core.failure_cause` reads them."""
    out = []
    for r in res.ranks:
        o = res.outcomes[r]
        out.append({"rank": r, "status": str(o.status), "ename": o.ename, "evalue": o.evalue,
                    "released": o.collective and o.ename != "PointToPointMismatchError",
                    "collective": _where_text(res.where.get(r))})
    return out


def case_checks(ex: Exercise, index: int, per_rank: list[dict], n: int) -> list[core.Check]:
    """The checks one case's measurements give (values always; the hook's
    future and overlap, the operations used, bytes and memory on the
    exercise's last case)."""
    ranks = {d["rank"]: d for d in per_rank}
    last = index == len(ex.cases) - 1
    out = []
    if ex.kind == "ddp_hook":
        out.append(core.future_check({r: d["kinds"] for r, d in ranks.items()}))
        out.append(core.overlap_check({r: d["pending"] for r, d in ranks.items()}))
    out.append(core.values_check(ex.case_label(index), {r: d["values"] for r, d in ranks.items()},
                                 ex.what, ex.wrong))
    if not last:
        return out
    tensor_bytes = per_rank[0]["tensor_bytes"]
    sent = {r: core.sent_bytes(d["ops"], n) for r, d in ranks.items()}
    if ex.kind == "tensor":
        if ex.only:
            out.append(core.only_check({r: d["ops"] for r, d in ranks.items()}, ex.only))
        if ex.optimum:
            out.append(core.bytes_check(sent, tensor_bytes, n, "tensor", ex.optimum))
    elif ex.kind == "ddp_hook":
        out.append(core.bytes_check(sent, tensor_bytes, n, "gradients"))
    else:  # ZeRO-1/2's optimum: a reduce-scatter of the gradients, an all-gather of the params
        per_step = {r: b // core.ZERO1_STEPS for r, b in sent.items()}
        out.append(core.bytes_check(per_step, tensor_bytes, n, "gradients (per step)"))
        out.append(core.memory_check({r: d["held"] for r, d in ranks.items()},
                                     [tuple(s) for s in ex.cases[index]], n,
                                     grads=ex.kind == "zero2_step"))
    return out


def grade_cases(c, ex: Exercise, name: str, timeout: float) -> tuple[list[core.Check], str]:
    """Every case of ``ex`` run on every rank of ``c``, the checks they give, and
    why the checks not made were not (a case that did not finish stops the rest:
    its ranks were released, and what follows it would measure a broken run)."""
    checks: list[core.Check] = []
    n = c.world_size
    for i in range(len(ex.cases)):
        res = c.call(ep.GRADE_CASE, ex, name, i, timeout=timeout, raise_errors=False)
        if not res.ok:
            log.info("grade %s: case %d failed: %s", ex.key, i, res.error)
            checks.append(core.run_check(ex.case_label(i),
                                         core.failure_cause(outcomes_of(res), timeout)))
            return checks, f"not run: {ex.case_label(i)} did not finish on every rank."
        checks += case_checks(ex, i, res.values, n)
    return checks, ""


def grade(c, key: str, name: str | None = None, *, reveal: bool = False,
          timeout: float = CASE_TIMEOUT_S, assignment: Assignment | None = None) -> core.Grade:
    """Grade the function ``name`` (default: the exercise's name) defined on
    every rank of ``c`` against exercise ``key`` of ``assignment`` (default:
    dpnb's own); see the module's docstring."""
    ex = (assignment or core.BUILTIN).exercise(key)
    name = name or ex.key
    missing = [r for r, m in enumerate(c.call(ep.HAS_NAMES, [name]).values) if m]
    if missing:
        raise ConfigError(f"{name} is not defined on rank(s) {', '.join(map(str, missing))}: "
                          f"define it in a %%dp cell ({ex.signature}), then grade again")
    checks, why = grade_cases(c, ex, name, timeout)
    slot = (ex.key, name)  # tries count per function: another name starts at hint one
    tries = c.grade_tries.get(slot, 0) + 1
    g = core.make_grade(ex, name, c.world_size, checks, tries=tries, answer=ex.answer,
                        reveal=reveal, why_missing=why)
    c.grade_tries[slot] = 0 if g.passed else tries
    return g
