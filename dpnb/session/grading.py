"""``%dp grade EXERCISE NAME``: the learner's function run on every rank, case by case.

For each case of the exercise (:data:`dpnb.core.grading.EXERCISES`) the
notebook calls :func:`dpnb.engine.grading.run_case` on every rank at once,
with a short timeout: a case that deadlocks or loops is interrupted and its
group released by the same wait that releases a ``%%dp --timeout`` cell
(:mod:`dpnb.cluster.waiting`), and the group re-formed; an exception on one
rank releases the others.  Either way the grade fails naming the cause, and
the engines live on.  What the ranks measured becomes checks
(:mod:`dpnb.core.grading`); hints grow with each failed try; the model
answer (package data, ``dpnb/answers/KEY.py.txt``) is shown after a pass or
with ``reveal``.  :func:`grade_notebook` grades a submitted notebook headless
(``dpnb grade NOTEBOOK --json``).
"""

from __future__ import annotations

import json
import logging
import os
from importlib import resources
from pathlib import Path

from ..core import grading as core
from ..core.errors import ConfigError
from dpnb.engine import entrypoints as ep

log = logging.getLogger(__name__)

#: seconds one case may run on the ranks before it is called a deadlock or a loop
#: (the cases are small: a correct answer takes milliseconds)
CASE_TIMEOUT_S = 8.0


def model_answer(key: str) -> str:
    """The exercise's model answer, from package data (never in a notebook)."""
    return resources.files("dpnb").joinpath("answers", f"{key}.py.txt").read_text()


def use_model_answer(c, key: str) -> None:
    """Define the exercise's model answer on every rank (a headless run of
    chapter 11 with ``-p MODEL_ANSWERS True``; the answer stays out of the notebook)."""
    c.run(model_answer(core.exercise(key).key), display=False, history=False)


def _where_text(a: dict | None) -> str:
    c = (a or {}).get("collective") or {}
    if not c:
        return ""
    peer = f" with rank {c['peer']}" if c.get("peer") is not None else ""
    line = (a or {}).get("user_line")
    return f"{c.get('op', '?')}{peer}" + (f" at {line}" if line else "")


def _outcomes(res) -> list[dict]:
    """The failed case's per-rank outcomes as :func:`core.failure_cause` reads them."""
    out = []
    for r in res.ranks:
        o = res.outcomes[r]
        out.append({"rank": r, "status": str(o.status), "ename": o.ename, "evalue": o.evalue,
                    "released": o.collective and o.ename != "PointToPointMismatchError",
                    "collective": _where_text(res.where.get(r))})
    return out


def case_checks(ex: core.Exercise, index: int, per_rank: list[dict], n: int) -> list[core.Check]:
    """The checks one case's measurements give (values always; bytes, memory,
    the hook's future on the exercise's last case)."""
    ranks = {d["rank"]: d for d in per_rank}
    case = ex.cases[index]
    last = index == len(ex.cases) - 1
    out = []
    if ex.key == "allreduce_hook":
        out.append(core.future_check({r: d["kinds"] for r, d in ranks.items()}))
        out.append(core.overlap_check({r: d["pending"] for r, d in ranks.items()}))
        what, wrong = "the gradient averaged over ranks", \
            "DDP writes the future's value into .grad: it must be the average of the ranks' gradients"
    elif ex.key == "ring_allreduce":
        what, wrong = "the sum over ranks", \
            "a chunk was added twice or missed: check which chunk each step sends and receives"
    else:
        what, wrong = "SGD with momentum on the averaged gradients", \
            "compare your update with the reference: average the gradients, then buf, then p"
    label = f"n={case[0]}" if ex.key == "ring_allreduce" else f"case {index + 1}"
    out.append(core.values_check(label, {r: d["values"] for r, d in ranks.items()}, what, wrong))
    if not last:
        return out
    tensor_bytes = per_rank[0]["tensor_bytes"]
    sent = {r: core.sent_bytes(d["ops"], n) for r, d in ranks.items()}
    if ex.key == "ring_allreduce":
        out.append(core.only_p2p_check({r: d["ops"] for r, d in ranks.items()}))
        out.append(core.bytes_check(sent, tensor_bytes, n, "tensor"))
    elif ex.key == "allreduce_hook":
        out.append(core.bytes_check(sent, tensor_bytes, n, "gradients"))
    else:  # ZeRO-1/2's optimum: a reduce-scatter of the gradients, an all-gather of the params
        per_step = {r: b // core.ZERO1_STEPS for r, b in sent.items()}
        out.append(core.bytes_check(per_step, tensor_bytes, n, "gradients (per step)"))
        out.append(core.memory_check({r: d["held"] for r, d in ranks.items()},
                                     [tuple(s) for s in case], n, grads=ex.key == "zero2_step"))
    return out


def grade(c, key: str, name: str | None = None, *, reveal: bool = False,
          timeout: float = CASE_TIMEOUT_S) -> core.Grade:
    """Grade the function ``name`` (default: the exercise's name) defined on
    every rank of ``c`` against exercise ``key``; see the module's docstring."""
    ex = core.exercise(key)
    name = name or ex.key
    missing = [r for r, m in enumerate(c.call(ep.HAS_NAMES, [name]).values) if m]
    if missing:
        raise ConfigError(f"{name} is not defined on rank(s) {', '.join(map(str, missing))}: "
                          f"define it in a %%dp cell ({ex.signature}), then grade again")
    n = c.world_size
    checks: list[core.Check] = []
    for i in range(len(ex.cases)):
        res = c.call(ep.GRADE_CASE, ex.key, name, i, timeout=timeout,
                     raise_errors=False)
        if not res.ok:
            log.info("grade %s: case %d failed: %s", ex.key, i, res.error)
            checks.append(core.run_check(core.failure_cause(_outcomes(res), timeout)))
            break
        checks += case_checks(ex, i, res.values, n)
    tries = c.grade_tries.get(ex.key, 0) + 1
    g = core.make_grade(ex, name, n, checks, tries=tries, answer=model_answer(ex.key),
                        reveal=reveal)
    c.grade_tries[ex.key] = 0 if g.passed else tries  # the next exercise's hints start at one
    record(g)
    return g


# ------------------------------------------------------------ a submitted notebook
def grade_notebook(path: str, out: str | None = None, *, timeout_s: float = 600.0) -> dict:
    """Execute a submitted notebook headless; every ``%dp grade`` in it lands
    in a grade file (points per check, nbgrader/otter style).  The notebook's
    kernel writes its grades to ``DPNB_GRADE_FILE`` (:func:`record`)."""
    # lazy: nbclient and nbformat are for the CLI only
    import nbformat
    from nbclient import NotebookClient

    src = Path(path)
    if not src.is_file():
        raise ConfigError(f"no notebook at {path}: give the submitted .ipynb")
    target = Path(out) if out else src.with_suffix(".grade.json")
    records = target.with_suffix(".jsonl")
    records.unlink(missing_ok=True)
    nb = nbformat.read(src, as_version=4)
    old = os.environ.get("DPNB_GRADE_FILE")
    os.environ["DPNB_GRADE_FILE"] = str(records)
    error = ""
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(src.parent)}}).execute()
    except Exception as e:  # a failing cell is the submission's: graded, and said  # noqa: BLE001
        log.info("grading %s: a cell failed: %s", src, e)
        error = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    finally:
        if old is None:
            os.environ.pop("DPNB_GRADE_FILE", None)
        else:
            os.environ["DPNB_GRADE_FILE"] = old
    grades = [json.loads(line) for line in records.read_text().splitlines()] \
        if records.exists() else []
    latest = {g["exercise"]: g for g in grades}  # the last try of each exercise counts
    result = {"notebook": str(src), "error": error, "exercises": list(latest.values()),
              "points": sum(g["points"] for g in latest.values()),
              "max_points": sum(g["max_points"] for g in latest.values())}
    target.write_text(json.dumps(result, indent=1))
    result["grade_file"] = str(target)
    return result


def record(g: core.Grade) -> None:
    """Append ``g`` to ``DPNB_GRADE_FILE`` when a headless grader set it."""
    path = os.environ.get("DPNB_GRADE_FILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(g.to_record()) + "\n")
