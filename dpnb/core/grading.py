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

import html
import math
from dataclasses import dataclass, field

from .comm import collective_bytes
from .errors import ConfigError
from .exact_memory import ParamSpec, exact_rank_bytes
from .units import fmt_bytes

#: relative tolerance of the value checks (float32 sums in another order)
RTOL = 1e-4
#: sent bytes up to this multiple of the optimum pass (uneven chunks round up)
BYTES_SLACK = 1.2
#: held optimizer state up to this multiple of 1/N of it passes (a shard rounds up)
MEMORY_SLACK = 1.25


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function the learner writes, what it must do, the cases run."""

    key: str
    signature: str
    statement: str
    hints: tuple[str, ...]
    cases: tuple  # each exercise's own case parameters (sizes, shapes)


EXERCISES: dict[str, Exercise] = {e.key: e for e in (
    Exercise(
        "ring_allreduce", "ring_allreduce(t)",
        "Sum the tensor t over every rank, in place, as a ring: split t into N chunks "
        "(the last ones may be shorter), N-1 reduce-scatter steps then N-1 all-gather "
        "steps, each rank sending one chunk to rank+1 and receiving one from rank-1. "
        "Use dist.send / dist.recv / dist.isend / dist.irecv only (no dist.all_reduce).",
        ("Each rank should send 2(N-1)/N of the tensor in all: one chunk per step, "
         "2(N-1) steps.",
         "At reduce-scatter step s, rank r sends chunk (r - s) mod N and receives and adds "
         "chunk (r - s - 1) mod N; at all-gather step s it sends chunk (r + 1 - s) mod N and "
         "copies what it receives into chunk (r - s) mod N.",
         "Post the receive with dist.irecv before the blocking send, or every rank sends "
         "first and waits for a peer that also sends; chunk sizes come from "
         "torch.tensor_split(t, N) on every rank, so sender and receiver agree."),
        ((16,), (1030,), (4099,))),
    Exercise(
        "allreduce_hook", "allreduce_hook(state, bucket)",
        "A DDP communication hook, as model.register_comm_hook(state, hook) takes: "
        "bucket.buffer() holds this rank's gradients of one bucket; return a "
        "torch.futures.Future whose value is that buffer averaged over the ranks "
        "(DDP copies it back into the .grad fields).",
        ("DDP waits on the future you return and writes its value into the gradients: "
         "that value must be the average, not the sum.",
         "dist.all_reduce(buf, async_op=True) returns a Work; .get_future() turns it into "
         "a Future, and .then(lambda f: f.value()[0] / world_size) divides once it is done.",
         "Divide by dist.get_world_size(), and return the future (a hook that returns "
         "None or the tensor is rejected by DDP)."),
        ((24, 48, 10, 0.001),)),
    Exercise(
        "zero1_step", "zero1_step(params, state, lr, momentum)",
        "One ZeRO-1 step of SGD with momentum. params: a list of tensors, equal on every "
        "rank, each with .grad holding this rank's own (not averaged) gradient. Update "
        "every param in place as torch.optim.SGD(lr=lr, momentum=momentum) would on the "
        "gradients averaged over ranks, keeping in the dict `state` (empty at the first "
        "step, the same dict at the next) only this rank's shard of the momentum: view "
        "the parameters as one flat vector of P elements; rank r owns elements "
        "[r*S, (r+1)*S) with S = ceil(P / N). Return nothing.",
        ("The momentum buffer is the optimizer state: each rank may keep only 1/N of it. "
         "Update your shard, then share the updated parameters.",
         "Flatten the gradients (torch.cat of g.flatten(), padded to N*S), reduce-scatter "
         "them (dist.reduce_scatter(mine, list(flat.chunk(N))): an all-reduce would send "
         "twice what your slice needs) and divide by N; update only your slice with "
         "buf = momentum * buf + grad (buf = grad at the first step), p -= lr * buf.",
         "Share the updated slices with dist.all_gather into N tensors of S elements "
         "(pad the flat vector to N*S), then copy the first P elements back into the "
         "params; keep buf in state['buf'], S elements only."),
        (((13,), (6, 3)), ((10, 7), (7,), (3, 5)))),
    Exercise(
        "zero2_step", "zero2_step(params, state, lr, momentum)",
        "One ZeRO-2 step: zero1_step's update (the same flat shards, S = ceil(P / N)), and "
        "the gradients sharded too. Once this rank's slice of the averaged gradient is "
        "reduce-scattered, nothing needs the full gradients any more: release them "
        "(p.grad = None on every param) and keep, between steps, only this rank's slice of "
        "the averaged gradient (state['grad'], S elements) and of the momentum "
        "(state['buf']). Return nothing.",
        ("ZeRO-2 holds 1/N of the gradients as well as 1/N of the optimizer state: a full "
         ".grad left on a param after the step is DDP's gradient memory.",
         "Start from a ZeRO-1 step that reduce-scatters the flat gradient; as soon as your "
         "slice is in hand, set p.grad = None for every param (the reduce-scatter has "
         "already read them).",
         "Keep state['grad'] = your averaged slice (S elements) and state['buf'] = the "
         "momentum slice; all-gather the updated parameter slices as in ZeRO-1."),
        (((13,), (6, 3)), ((10, 7), (7,), (3, 5)))),
)}

#: the zero1 exercise's optimizer settings and steps per case
ZERO1_LR, ZERO1_MOMENTUM, ZERO1_STEPS = 0.1, 0.9, 3


def exercise(key: str) -> Exercise:
    try:
        return EXERCISES[key]
    except KeyError:
        raise ConfigError(f"no exercise {key!r}: use one of {', '.join(EXERCISES)}") from None


@dataclass(frozen=True)
class Check:
    """One thing measured on the ranks: ``measured`` beside ``expected``, and why it failed."""

    name: str
    passed: bool
    measured: str
    expected: str
    sentence: str = ""
    points: int = 1


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


def make_grade(ex: Exercise, name: str, world: int, checks: list[Check], *, tries: int,
               answer: str = "", reveal: bool = False) -> Grade:
    """The grade with its report: hints grow with each failed try (``tries``
    counts this one); the answer shows only after a pass or with ``reveal``."""
    g = Grade(ex.key, name, world, tuple(checks))
    hints = () if g.passed else ex.hints[:max(1, min(tries, len(ex.hints)))]
    shown = answer if (g.passed or reveal) else ""
    g = Grade(ex.key, name, world, tuple(checks), hints, shown)
    return Grade(ex.key, name, world, tuple(checks), hints, shown, report_text(g))


def report_text(g: Grade) -> str:
    got, total = g.points
    head = (f"{g.exercise} ({g.name}) on {g.world_size} ranks: "
            f"{'PASSED' if g.passed else 'not yet'} -- {got}/{total} checks")
    lines = [head]
    for c in g.checks:
        mark = "ok  " if c.passed else "FAIL"
        lines.append(f"  {mark} {c.name}: {c.measured} (expected {c.expected})")
        if c.sentence and not c.passed:
            lines.append(f"       {c.sentence}")
    for i, h in enumerate(g.hints, 1):
        lines.append(f"Hint {i}: {h}")
    if not g.passed and g.hints:
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
    if most <= best * BYTES_SLACK + 16 * n:
        return Check("bytes sent", True, measured, expected)
    times = most / best if best else math.inf
    sentence = (f"rank {worst_rank} sent {most / tensor_bytes:.2f}x the tensor, {times:.1f} times "
                f"as much as a ring's 2(N-1)/N = {factor:.2f}x")
    if most >= (n - 1) * tensor_bytes * 0.95:
        sentence += (f": sending the whole tensor to every other rank costs N-1 = {n - 1} times "
                     f"the tensor ({fmt_bytes((n - 1) * tensor_bytes)})")
    return Check("bytes sent", False, measured, expected, sentence + ".")


def only_p2p_check(ops: dict[int, dict]) -> Check:
    """The ring exercise: only send / recv / isend / irecv."""
    used = sorted({op for per in ops.values() for op in per
                   if op not in ("send", "isend", "recv", "irecv")})
    if not used:
        return Check("point-to-point only", True, "send/recv only", "send/recv only")
    return Check("point-to-point only", False, ", ".join(used), "send/recv only",
                 f"the ring must be built from send/recv: {', '.join(used)} does the exercise for you.")


#: a torch.distributed function -> the ring collective it is costed as
OP_KIND = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
           "reduce_scatter_tensor": "reduce_scatter", "all_gather": "all_gather",
           "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce"}


def sent_bytes(ops: dict[str, list], n: int) -> int:
    """What one rank sent: point-to-point sends count their tensor; a
    collective its ring cost (:func:`collective_bytes`) on its full buffer
    (``ops[op] = [calls, full buffer bytes]``, :mod:`dpnb.engine.grading`)."""
    total = 0.0
    for op, (_calls, nbytes) in ops.items():
        if op in ("send", "isend"):
            total += nbytes
        elif op in OP_KIND:
            total += collective_bytes(OP_KIND[op], nbytes, n)  # type: ignore[arg-type]
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
        why = "no tensor was kept in state: the momentum must survive to the next step"
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
        why = "no tensor was kept in state: the momentum must survive to the next step"
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


def run_check(cause: str) -> Check:
    """A case that did not finish on every rank: its cause is the feedback."""
    return Check("runs on every rank", False, "did not finish", "finishes", cause)


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
