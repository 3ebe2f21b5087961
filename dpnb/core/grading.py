"""Exercises graded on the live cluster: what each asks, and how a grade reads (pure).

A learner writes the distributed code (a ring all-reduce, a DDP comm hook, a
ZeRO-1 step) in a ``%%dp`` cell; ``%dp grade EXERCISE NAME`` calls it on every
rank (:mod:`dpnb.engine.grading` runs the cases and measures) and this module
turns what the ranks measured into :class:`Check` s: the values against a
reference, the bytes each rank *sent* against the algorithm's optimum
(:func:`dpnb.core.comm.collective_bytes`: a ring all-reduce sends 2(N-1)/N of
the tensor), the optimizer state each rank *held* against the exact model
(:mod:`dpnb.core.exact_memory`: ZeRO-1 keeps 1/N of it).  A :class:`Grade`
holds the checks, a report in a learner's words and the hints earned so far;
the model answer (package data, :mod:`dpnb.session.grading`) only after a
pass or on request.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
from dataclasses import dataclass, field

from .comm import collective_bytes
from .assignment import Assignment, Exercise, load_assignment, only_label, planned_checks
from .exact_memory import ParamSpec, exact_rank_bytes
from .units import fmt_bytes

#: relative tolerance of the value checks (float32 sums in another order)
RTOL = 1e-4
#: sent bytes up to this multiple of the optimum pass (uneven chunks round up)
BYTES_SLACK = 1.2
#: held optimizer state up to this multiple of 1/N of it passes (a shard rounds up)
MEMORY_SLACK = 1.25



@functools.lru_cache(maxsize=1)
def _builtin() -> Assignment:
    return load_assignment()


def __getattr__(name: str):
    """``BUILTIN`` (dpnb's own assignment, ``dpnb/assignments/builtin.toml``) and
    ``EXERCISES`` (its exercises by key), read at first use, not at import: a
    broken package file must not break ``import dpnb``."""
    if name == "BUILTIN":
        return _builtin()
    if name == "EXERCISES":
        return {e.key: e for e in _builtin().exercises}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: the zero1 exercise's optimizer settings and steps per case
ZERO1_LR, ZERO1_MOMENTUM, ZERO1_STEPS = 0.1, 0.9, 3


def exercise(key: str) -> Exercise:
    return _builtin().exercise(key)


@dataclass(frozen=True)
class Check:
    """One thing measured on the ranks: ``measured`` beside ``expected``, and why it failed."""

    name: str
    passed: bool
    measured: str
    expected: str
    sentence: str = ""
    points: int = 1
    family: str = ""  # which of the exercise's checks (its hints and points: core.assignment)


@dataclass(frozen=True)
class Grade:
    """The grade of one try: every check made, and the report a learner reads."""

    exercise: str
    name: str
    world_size: int
    checks: tuple[Check, ...]
    hints: tuple[str, ...] = ()
    answer: str = ""  # the model answer: only after a pass, or when asked for
    report: str = field(default="", compare=False)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def points(self) -> tuple[int, int]:
        """(earned, possible), nbgrader/otter style: one check, its points."""
        return (sum(c.points for c in self.checks if c.passed), sum(c.points for c in self.checks))

    def __str__(self) -> str:
        return self.report

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's text form
        p.text(self.report)

    def _repr_html_(self) -> str:
        return grade_html(self)

    def to_record(self) -> dict:
        """A course tool's view: points per check (JSON-safe)."""
        got, total = self.points
        return {"exercise": self.exercise, "name": self.name, "world_size": self.world_size,
                "passed": self.passed, "points": got, "max_points": total,
                "checks": [{"name": c.name, "passed": c.passed, "points": c.points if c.passed else 0,
                            "max_points": c.points, "measured": c.measured,
                            "expected": c.expected, "feedback": c.sentence}
                           for c in self.checks]}


def complete(ex: Exercise, measured: list[Check], why_missing: str = "") -> tuple[Check, ...]:
    """Every check ``ex`` plans, in its order, with the assignment's points: the
    measured one where it was made, else failed and not run, saying why."""
    by_name = {c.name: c for c in measured}
    out = []
    for spec in planned_checks(ex):
        c = by_name.get(spec.name)
        if c is None:
            c = Check(spec.name, False, "not run", "", why_missing or "not run.", family=spec.family)
        out.append(dataclasses.replace(c, points=spec.points, family=c.family or spec.family))
    return tuple(out)


def make_grade(ex: Exercise, name: str, world: int, checks: list[Check], *, tries: int,
               answer: str = "", reveal: bool = False, why_missing: str = "",
               practice: bool = True) -> Grade:
    """The grade with its report: every planned check (:func:`complete`); the
    hints are the first failing check's own, more with each failed try
    (``tries`` counts this one); the answer shows only after a pass or with ``reveal``."""
    full = complete(ex, checks, why_missing)
    failing = next((c for c in full if not c.passed), None)
    hints = () if failing is None else ex.hints_for(failing.family)
    hints = hints[:max(1, min(tries, len(hints)))] if hints else ()
    g = Grade(ex.key, name, world, full)
    shown = answer if (g.passed or reveal) else ""
    g = Grade(ex.key, name, world, full, hints, shown)
    return Grade(ex.key, name, world, full, hints, shown, report_text(g, practice=practice))


def report_text(g: Grade, *, practice: bool = True) -> str:
    """The grade in a learner's words; checks not run for one reason are one line.
    ``practice``: end with how to get the next hint (``%dp grade``; not a roster's)."""
    got, total = g.points
    head = (f"{g.exercise} ({g.name}) on {g.world_size} ranks: "
            f"{'PASSED' if g.passed else 'not yet'} -- {got}/{total} checks")
    lines = [head]
    i = 0
    while i < len(g.checks):
        c = g.checks[i]
        if c.measured == "not run":  # a run of checks skipped for one reason: said once
            j = i
            while j + 1 < len(g.checks) and g.checks[j + 1].measured == "not run" \
                    and g.checks[j + 1].sentence == c.sentence:
                j += 1
            lines.append(f"  FAIL {', '.join(x.name for x in g.checks[i:j + 1])}: not run")
            lines.append(f"       {c.sentence}")
            i = j + 1
            continue
        mark = "ok  " if c.passed else "FAIL"
        lines.append(f"  {mark} {c.name}: {c.measured}"
                     + (f" (expected {c.expected})" if c.expected else ""))
        if c.sentence and not c.passed:
            lines.append(f"       {c.sentence}")
        i += 1
    for k, h in enumerate(g.hints, 1):
        lines.append(f"Hint {k}: {h}")
    if practice and not g.passed and g.hints:
        lines.append("(grade again for another hint; --reveal shows the model answer)")
    if g.answer:
        lines += ["Model answer:", g.answer.rstrip()]
    return "\n".join(lines)


def grade_html(g: Grade) -> str:
    color = "#2a2" if g.passed else "#c33"
    rows = "".join(
        f"<tr><td>{'&#10003;' if c.passed else '&#10007;'}</td><td>{html.escape(c.name)}</td>"
        f"<td>{html.escape(c.measured)}</td><td>{html.escape(c.expected)}</td>"
        f"<td>{'' if c.passed else html.escape(c.sentence)}</td></tr>" for c in g.checks)
    got, total = g.points
    hints = "".join(f"<li>{html.escape(h)}</li>" for h in g.hints)
    answer = f"<details open><summary>Model answer</summary><pre>{html.escape(g.answer)}</pre></details>" \
        if g.answer else ""
    return (f"<div class='dpnb-grade'><b style='color:{color}'>{html.escape(g.exercise)} "
            f"({html.escape(g.name)}) on {g.world_size} ranks: "
            f"{'passed' if g.passed else 'not yet'} ({got}/{total})</b>"
            f"<table><tr><th></th><th>check</th><th>measured</th><th>expected</th><th></th></tr>"
            f"{rows}</table>{'<ol>' + hints + '</ol>' if hints else ''}{answer}</div>")


# --------------------------------------------------------------- the checks
def values_check(label: str, ranks: dict[int, dict], what: str, wrong_hint: str) -> Check:
    """Every rank's result against the reference: ``ranks[r]`` holds ``bad``
    (elements off), ``numel``, ``max_err`` and ``ratio`` (result / reference,
    least squares: 4.0 is a sum where an average was due, at N = 4) and
    ``scaled`` (the whole result is that multiple of the reference)."""
    bad = {r: v for r, v in sorted(ranks.items()) if v["bad"]}
    if not bad:
        n = next(iter(ranks.values()))["numel"]
        return Check(f"values ({label})", True, f"all {n} elements right on every rank",
                     f"{what}")
    r, v = next(iter(bad.items()))
    ratio = v.get("ratio")
    scaled = v.get("scaled") and ratio is not None and abs(ratio - 1) > 0.05
    why = (f"rank {r}'s result is {ratio:.2f}x {what}" if scaled else
           f"rank {r} has {v['bad']} of {v['numel']} elements wrong (largest error "
           f"{v['max_err']:.3g})")
    ranks_off = ", ".join(str(k) for k in bad)
    return Check(f"values ({label})", False, f"{v['bad']}/{v['numel']} elements off on rank(s) "
                 f"{ranks_off}", what, f"{why}: {wrong_hint}")


def bytes_check(sent: dict[int, int], tensor_bytes: int, n: int, what: str,
                optimum_kind: str = "all_reduce") -> Check:
    """Bytes each rank sent beside the ring's optimum for ``tensor_bytes``."""
    best = collective_bytes(optimum_kind, tensor_bytes, n)  # type: ignore[arg-type]
    worst_rank = max(sent, key=lambda r: sent[r])
    most = sent[worst_rank]
    factor = 2 * (n - 1) / n if optimum_kind == "all_reduce" else (n - 1) / n
    expected = f"<= {fmt_bytes(best)} = {factor:.2f}x the {fmt_bytes(tensor_bytes)} {what}"
    measured = f"rank {worst_rank} sent {fmt_bytes(most)} ({most / tensor_bytes:.2f}x)"
    silent = sorted(r for r, b in sent.items() if b == 0)
    if silent and n > 1:  # every rank's data must leave it for the others to have it
        return Check("bytes sent", False, f"rank {silent[0]} sent 0 B", expected,
                     f"no byte sent was counted on rank(s) {', '.join(map(str, silent))}, yet "
                     "every rank's data must reach the others: dpnb counts every "
                     "torch.distributed operation made on the thread that runs your function "
                     "(and DDP's own threads) -- communicate from there, through "
                     "torch.distributed.")
    if most <= best * BYTES_SLACK + 16 * n:
        return Check("bytes sent", True, measured, expected)
    times = most / best if best else math.inf
    sentence = (f"rank {worst_rank} sent {most / tensor_bytes:.2f}x the tensor, {times:.1f} times "
                f"as much as a ring's 2(N-1)/N = {factor:.2f}x")
    if most >= (n - 1) * tensor_bytes * 0.95:
        sentence += (f": sending the whole tensor to every other rank costs N-1 = {n - 1} times "
                     f"the tensor ({fmt_bytes((n - 1) * tensor_bytes)})")
    return Check("bytes sent", False, measured, expected, sentence + ".")


def only_check(ops: dict[int, dict], allowed: tuple[str, ...]) -> Check:
    """Only the ``allowed`` operations, as counted below torch.distributed's
    Python names (a process group's own methods and functional collectives
    count as the collective they are: :mod:`dpnb.engine.grading`)."""
    want = "/".join(allowed) + " only"
    name = only_label(allowed)
    used = sorted({op for per in ops.values() for op in per if op not in allowed})
    if not used:
        return Check(name, True, want, want)
    return Check(name, False, ", ".join(used), want,
                 f"use {', '.join(allowed)} only: {', '.join(used)} does the exercise for you.")


#: a torch.distributed function -> the ring collective it is costed as
OP_KIND = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
           "reduce_scatter_tensor": "reduce_scatter", "all_gather": "all_gather",
           "all_gather_into_tensor": "all_gather", "broadcast": "broadcast", "reduce": "reduce"}


def sent_bytes(ops: dict[str, list], n: int) -> int:
    """What one rank sent (``ops[op] = [calls, bytes]``, :mod:`dpnb.engine.gradecount`):
    a collective of :data:`OP_KIND` is given by its full buffer and costed as a
    ring (:func:`collective_bytes`); anything else -- a send, a gather, a
    scatter, an all-to-all -- by the bytes that left the rank."""
    total = 0.0
    for op, (_calls, nbytes) in ops.items():
        if op in OP_KIND:
            total += collective_bytes(OP_KIND[op], nbytes, n)  # type: ignore[arg-type]
        else:
            total += nbytes
    return int(total)


def memory_check(held: dict[int, int], shapes: list[tuple[int, ...]], n: int,
                 *, grads: bool = False) -> Check:
    """ZeRO-1: each rank's momentum bytes beside 1/N of what DDP's SGD keeps
    (:func:`dpnb.core.exact_memory.exact_rank_bytes`, ``sgd-momentum``).
    ``grads``: ZeRO-2, whose rank also keeps only 1/N of the gradients -- the
    bytes held (state and any ``.grad`` left) beside 1/N of DDP's gradients
    plus momentum."""
    specs = [ParamSpec(f"p{i}", tuple(s)) for i, s in enumerate(shapes)]
    ddp = exact_rank_bytes(specs, n, "ddp", "sgd-momentum")[0]
    if grads:
        return _zero2_memory(held, ddp.grads, ddp.optimizer_moments, n)
    full = ddp.optimizer_moments
    share = full / n
    worst = max(held, key=lambda r: held[r])
    measured = f"rank {worst} keeps {fmt_bytes(held[worst])} of momentum"
    expected = f"~{fmt_bytes(share)} = 1/{n} of {fmt_bytes(full)}"
    if 0 < held[worst] <= share * MEMORY_SLACK + 16:
        return Check("optimizer state held", True, measured, expected)
    if held[worst] == 0:
        why = ("no tensor the step created was alive after it: the momentum must survive to the "
               "next step (state['buf'])")
    elif held[worst] >= full * 0.95:
        why = (f"rank {worst} keeps the whole momentum ({fmt_bytes(held[worst])}): that is DDP's "
               f"memory; ZeRO-1 keeps 1/{n} of it on each rank")
    else:
        why = f"rank {worst} keeps {held[worst] / full:.2f} of the momentum; ZeRO-1 keeps 1/{n}"
    return Check("optimizer state held", False, measured, expected, why + ".")


def _zero2_memory(held: dict[int, int], grad_bytes: int, moment_bytes: int, n: int) -> Check:
    """ZeRO-2's bytes after a step: 1/N of the gradients and 1/N of the momentum."""
    share = (grad_bytes + moment_bytes) / n
    worst = max(held, key=lambda r: held[r])
    name = "gradients and optimizer state held"
    measured = f"rank {worst} keeps {fmt_bytes(held[worst])} of gradients and momentum"
    expected = (f"~{fmt_bytes(share)} = 1/{n} of {fmt_bytes(grad_bytes)} of gradients "
                f"+ {fmt_bytes(moment_bytes)} of momentum")
    if 0 < held[worst] <= share * MEMORY_SLACK + 16:
        return Check(name, True, measured, expected)
    if held[worst] == 0:
        why = ("no tensor the step created was alive after it: the momentum must survive to the "
               "next step (state['buf'])")
    elif held[worst] >= grad_bytes:
        why = (f"rank {worst} still holds {fmt_bytes(held[worst])}, as much as the full gradients "
               f"({fmt_bytes(grad_bytes)}): release them (p.grad = None) once reduce-scattered; "
               f"ZeRO-2 keeps 1/{n} of the gradients")
    else:
        why = (f"rank {worst} keeps {held[worst] / (grad_bytes + moment_bytes):.2f} of the gradients "
               f"and momentum; ZeRO-2 keeps 1/{n}")
    return Check(name, False, measured, expected, why + ".")


def future_check(kinds: dict[int, list[str]]) -> Check:
    """The hook returned a ``torch.futures.Future`` for every bucket."""
    seen = sorted({k for per in kinds.values() for k in per})
    if not seen:
        return Check("returns a Future", False, "never called", "Future",
                     "DDP never called the hook.")
    ok = seen == ["Future"]
    return Check("returns a Future", ok, ", ".join(seen), "Future",
                 "" if ok else "DDP waits on the Future the hook returns: return one.")


def overlap_check(pending: dict[int, list[bool]]) -> Check:
    """The hook launched its communication and returned before it finished
    (for some bucket on some rank): backward can go on while buckets travel.
    A hook that waits for its all-reduce returns finished futures only."""
    flags = [f for per in pending.values() for f in per]
    running = sum(flags)
    measured = f"{running} of {len(flags)} buckets still in flight when the hook returned"
    if running:
        return Check("overlaps backward", True, measured, "some in flight")
    return Check("overlaps backward", False, measured, "some in flight",
                 "every bucket's future was already done when the hook returned: the hook waited "
                 "for its all-reduce, so backward stood still while each bucket was sent -- launch "
                 "it with async_op=True and return its future.")


def run_check(label: str, cause: str) -> Check:
    """A case that did not finish on every rank: its values check fails with the cause."""
    return Check(f"values ({label})", False, "did not finish on every rank",
                 "finishes on every rank", cause, family="runs")


def _deadlock_why(ops: set[str]) -> str:
    if ops == {"send"}:
        return ("every rank is in a blocking send, and a send waits for its peer's recv: post "
                "the receive first (irecv) or send with isend.")
    if ops == {"recv"}:
        return ("every rank waits in recv and none sends: post the receive with irecv, then "
                "send, then wait.")
    return "each waits for a message no rank will send (a blocking send or recv on both sides?)."


def failure_cause(outcomes: list[dict], timeout_s: float) -> str:
    """One sentence for a case that failed: ``outcomes`` per rank: ``rank``,
    ``status`` (a :class:`dpnb.cluster.types.Status` word), ``ename``,
    ``evalue``, ``collective`` (what the rank was blocked in, if it was)."""
    died = [o for o in outcomes if o["status"] == "died"]
    if died:
        return (f"rank(s) {', '.join(str(o['rank']) for o in died)} died: the process exited "
                "while the code ran (os._exit, a crash in native code, or killed).")
    raised = [o for o in outcomes if o["status"] == "error" and not o.get("released")]
    mismatch = [o for o in raised if o["ename"] == "PointToPointMismatchError"]
    if mismatch:
        return (f"sizes differ between a send and its recv -- {mismatch[0]['evalue'].split(':')[0]}"
                " -- check the chunk sizes each side uses (no engine died).")
    if raised:
        o = raised[0]
        return (f"rank {o['rank']} raised {o['ename']}: {o['evalue'].strip().splitlines()[0][:200]}"
                if o["evalue"].strip() else f"rank {o['rank']} raised {o['ename']}") + \
            " (the other ranks were released; every engine is kept)."
    late = [o for o in outcomes if o["status"] in ("timeout", "deadlocked", "stopped", "late")]
    blocked = [o for o in late if o.get("collective")]
    running = [o for o in late if not o.get("collective")]
    if running and not blocked:
        return (f"rank(s) {', '.join(str(o['rank']) for o in running)} still ran their own code "
                f"after {timeout_s:g} s -- an endless loop? They were interrupted.")
    if blocked and not running:
        what = "; ".join(f"rank {o['rank']} in {o['collective']}" for o in blocked[:4])
        return (f"deadlock: after {timeout_s:g} s every rank waited for a peer ({what}) -- "
                f"{_deadlock_why({o['collective'].split(' ')[0] for o in blocked})} "
                "The ranks were released; every engine is kept.")
    if blocked:
        return (f"rank(s) {', '.join(str(o['rank']) for o in running)} still ran their own code "
                f"after {timeout_s:g} s while the others waited for them in a collective.")
    return f"the case did not finish on every rank ({', '.join(o['status'] for o in outcomes)})."
