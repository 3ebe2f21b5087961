"""From per-rank outcomes to the one error the user reads.  Pure: no I/O.

N ranks ran a cell; some raised, some died, some timed out, and some only
failed because they were blocked in a collective with one that did (they
report a gloo/NCCL error once the peer went away or the group timeout hit).
This module sorts them -- culprits first, then the ranks that were merely
waiting -- and writes the report: one traceback per distinct failure, the
user's own cell line, and what happened to the process group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ..core.paths import shown_path
from dpnb.engine.cell.collcheck import DEVICE_WAIT_OP, MOVED_PREFIX, POINT_TO_POINT, moved_notes
from ..errors import DpnbError, RemoteCellError
from ..ranks import rank_label
from .types import USER_ENAMES, CellResult, RankOutcome, Status

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_NO = re.compile(r"Cell In\[\d+\]")

# Errors that mean "a collective or the group failed", not "the user's code
# raised": gloo/NCCL timeouts, a peer closing its connection, store errors.
_COLLECTIVE_ENAMES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError",
                      "CheckReleased"}  # dpnb's collective check, shut by a release
_COLLECTIVE_PATTERNS = re.compile(
    r"gloo|nccl|Timed out|timed out|Connection closed by peer|Connection reset by peer|"
    r"ProcessGroup|process group|collective operation timeout|Socket Timeout|"
    r"Broken pipe|TCPStore|store_based_barrier|Watchdog|monitoredBarrier", re.I)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text or "")


def is_collective_error(ename: str, evalue: str, traceback: str = "") -> bool:
    """Whether an error came from torch.distributed rather than the user's code."""
    if ename in _COLLECTIVE_ENAMES:
        return True
    return ename == "RuntimeError" and bool(_COLLECTIVE_PATTERNS.search(evalue or ""))


def group_identical(items: dict[int, str]) -> list[tuple[list[int], str]]:
    """``{rank: text}`` -> ``[(ranks, text), ...]`` in order of first rank."""
    groups: dict[str, list[int]] = {}
    for r in sorted(items):
        groups.setdefault(items[r], []).append(r)
    return sorted(((rs, t) for t, rs in groups.items()), key=lambda g: g[0][0])


_FRAME = re.compile(r"\s*(?:Cell In\[\d+\], line (\d+)|File (\S+?):(\d+))")
#: paths of library frames in a traceback (the user's own files are the rest)
_LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3\.\d+/|/dpnb/|^<")


def user_line(traceback: str) -> str:
    """The user's failing line from an IPython traceback -- its innermost frame
    in a cell or in the user's own file: ``cell line 3: x = f()``,
    ``a/train.py line 42: loss.backward()`` (the file's path below the
    notebook's folder, else in full: two scripts' ``utils.py`` differ)."""
    lines = strip_ansi(traceback).splitlines()
    found = ""
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if not m or (m.group(2) and _LIBRARY.search(m.group(2))):
            continue
        where = (f"cell line {m.group(1)}" if m.group(1) else
                 f"{shown_path(m.group(2))} line {m.group(3)}")
        found = where
        for nxt in lines[i + 1:]:
            if _FRAME.match(nxt):
                break
            a = re.match(r"\s*-+>\s*(\d+)\s?(.*)", nxt)
            if a:
                found = f"{where.rsplit(' ', 1)[0]} {a.group(1)}: {a.group(2).strip()}"
                break
    return found


def cell_notes(res: CellResult) -> list[str]:
    """Every rank's notes, each distinct one once, in rank order; the ranks' records
    of calls that repeated the agreed loop from another line, compared and said only
    where they differ (:func:`~dpnb.engine.cell.collcheck.moved_notes`)."""
    out: list[str] = []
    for r in res.ranks:
        out += [n for n in res.outcomes[r].notes if n not in out and not n.startswith(MOVED_PREFIX)]
    return out + moved_notes({r: res.outcomes[r].notes for r in res.ranks})


def first_error(res: CellResult) -> str:
    """``rank 1: error: ValueError: ...`` for the lowest rank that did not succeed."""
    for r in res.ranks:
        o = res.outcomes[r]
        if o.status != Status.OK:
            detail = o.died or f"{o.ename}: {o.evalue}".strip(": ")
            return f"rank {r}: {o.status}: {detail}"
    return "unknown error"


def kept(ranks: Iterable[int]) -> str:
    """``ranks 0,1 keep their state``."""
    rs = sorted(ranks)
    if not rs:
        return "no rank survived, so nothing on the engines was kept"
    return f"{rank_label(rs)} {'keeps its' if len(rs) == 1 else 'keep their'} state"


def plain_user_error(res: CellResult) -> DpnbError | None:
    """Every rank refused the same bad input: one line, no traceback.

    dpnb's engine functions raise ``TrainError`` (and friends) for mistakes
    the user can fix, on every rank alike, before any collective; that
    deserves the one-line message, not a report.
    """
    outs = [res.outcomes[r] for r in res.ranks]
    if all(o.status == Status.ERROR and o.ename in USER_ENAMES for o in outs) and \
            len({o.evalue for o in outs}) == 1:
        return DpnbError(outs[0].evalue)
    return None


#: the ename of dpnb.engine.cell.collcheck.CollectiveMismatchError
MISMATCH_ENAME = "CollectiveMismatchError"


def is_mismatch(o: RankOutcome) -> bool:
    """The ranks called different collectives and none ran (the cell guard's check)."""
    return o.status == Status.ERROR and o.ename == MISMATCH_ENAME


def mismatch_report(res: CellResult, ranks: list[int]) -> str:
    """Every rank raised the same table (each rank's op, shape, dtype, line): show it once."""
    texts = {res.outcomes[r].evalue for r in ranks}
    return " / ".join(sorted(texts))


def _at(a: dict, inside: bool = True) -> str:
    """`` at cell line 4, inside torch.distributed.checkpoint`` (the user's own
    line first; the library it called into after it)."""
    line = a.get("user_line") or (f"cell line {a['cell_line']}" if a.get("cell_line") else "")
    if not line:
        return ""
    lib = a.get("inside") if inside else ""
    return f" at {line}" + (f", inside {lib}" if lib else "")


def _blocked_line(r: int, a: dict) -> str:
    c = a["collective"]
    seq = f" #{c['seq']}" if c.get("seq") else ""
    shape = f" (shape {c['shape']}, {c.get('dtype')})" if c.get("shape") is not None else ""
    if c.get("device_wait"):  # NCCL: the collective is queued on the GPU, not in a c10d frame
        return (f"rank {r} is waiting for its GPU's queued work (a {c['op']}; under NCCL, most "
                f"likely a collective a peer has not joined){_at(a, inside=False)}")
    head = f"rank {r} is blocked in {c['op']}{seq}{shape}{_at(a, inside=False)}"
    if c.get("phase") == "check" and c.get("awaiting"):
        head += (f" (in dpnb's check before it, waiting for rank "
                 f"{', '.join(map(str, c['awaiting']))})")
    return head


def _never_came(a: dict, op: str) -> str:
    if not a.get("selected", True):
        return "does not run this cell (not among its --ranks)"
    if op == DEVICE_WAIT_OP:
        return "finished the cell"
    done = (a.get("cell_calls") or {}).get(op, 0)
    if op in POINT_TO_POINT:
        other = "recv" if op.endswith("send") else "send"
        n = sum((a.get("cell_calls") or {}).get(o, 0) for o in (other, "i" + other))
        return "finished the cell without a matching " + other if n == 0 else \
            f"finished the cell after only {n} {other}"
    return "finished the cell " + ("without entering it" if done == 0 else
                                   f"after only {done} {op}")


#: how a blocked rank whose peer is still busy in its own code is named
WAITS_FOR_BUSY = "a wait, not a deadlock"


def where_verdict(res: CellResult) -> str:
    """``rank 1 is blocked in all_reduce #1 ... ; rank 0 finished the cell without entering it``."""
    w = res.where
    if not w:
        return ""
    lines = []
    blocked = {r: a for r, a in w.items() if a.get("running") and a.get("collective")}
    # ranks still running their own code: a blocked rank waits for them, and
    # goes on when they get there -- a wait, not a deadlock (not released)
    busy = sorted(r for r, a in w.items() if a.get("running") and r not in blocked)
    for r, a in sorted(blocked.items()):
        line = _blocked_line(r, a)
        if busy:
            line += (f" -- {rank_label(busy)} {'is' if len(busy) == 1 else 'are'} still running "
                     f"{'its' if len(busy) == 1 else 'their'} code: {WAITS_FOR_BUSY}")
        lines.append(line)
    for r, a in sorted(w.items()):
        if r in blocked:
            continue
        if a.get("running"):
            what = "Python code" if a.get("user_line") else (a.get("top") or "Python code")
            if a.get("debugger"):
                what = "the debugger (pdb)"
            lines.append(f"rank {r} is running {what}{_at(a)}")
            continue
        for b in blocked.values():
            lines.append(f"rank {r} {_never_came(a, b['collective']['op'])}")
            break
    return "; ".join(lines)


@dataclass(frozen=True)
class Diagnosis:
    """Who did what in a failed cell.

    ``culprits``: ranks whose own code raised, that died or timed out.
    ``waiting``: ranks whose only error is a collective one while a culprit
    exists -- they were blocked with it.  ``needs_reform``: the group saw a
    collective error, a timeout or an interrupt and cannot be trusted.
    """

    died: dict[int, str]
    timed_out: list[int]
    culprits: list[int]
    waiting: list[int]
    interrupted: list[int]
    needs_reform: bool
    mismatch: list[int]


def where_report(sel: list[int], answers: dict, *, busy: set, dead: dict) -> str:
    """``%dp where``: the verdict over the busy ranks' side-door answers, then
    one line per dead, silent or idle rank."""
    res = CellResult(ranks=sel, outcomes={r: RankOutcome(rank=r) for r in sel}, elapsed_s=0.0,
                     where={r: dict(a, running=r in busy) for r, a in answers.items() if a})
    lines = []
    verdict = where_verdict(res)
    if verdict:
        lines.append(verdict)
    for r in sel:
        a = answers.get(r)
        if r in dead:
            lines.append(f"rank {r}: dead ({dead[r]})")
        elif a is None:
            lines.append(f"rank {r}: no answer from its side door")
        elif r not in busy:
            lines.append(f"rank {r}: idle" + (f" (last cell ran {a['cell_calls']})"
                                              if a.get("cell_calls") else ""))
    return "\n".join(lines) or "every selected rank is idle"


def classify(res: CellResult) -> Diagnosis:
    oc = res.outcomes
    failed = {r: o for r, o in oc.items() if o.status != Status.OK}
    died = {r: o.died for r, o in failed.items() if o.status == Status.DIED}
    timed_out = sorted(r for r, o in failed.items() if o.status == Status.TIMEOUT)
    mismatch = sorted(r for r, o in failed.items() if is_mismatch(o))
    own = sorted(r for r, o in failed.items() if o.status == Status.ERROR and not o.collective
                 and r not in mismatch)
    coll = sorted(r for r, o in failed.items() if o.status == Status.ERROR and o.collective
                  and r not in mismatch)
    interrupted = sorted(r for r, o in failed.items() if o.status == Status.INTERRUPTED)
    stopped = sorted(r for r, o in failed.items() if o.status == Status.STOPPED)
    stuck = sorted(r for r, o in failed.items() if o.status == Status.DEADLOCKED)
    frozen = sorted(r for r, o in failed.items() if o.status == Status.FROZEN)
    culprits = sorted(set(own) | set(died) | set(timed_out) | set(mismatch) | set(stuck)
                      | set(frozen))
    return Diagnosis(died=died, timed_out=timed_out, culprits=culprits,
                     waiting=sorted(set(coll) | set(stopped)) if culprits else [],
                     interrupted=interrupted,
                     # a mismatch ran no collective: the group is as good as before
                     needs_reform=bool(coll or timed_out or interrupted or res.released),
                     mismatch=mismatch)


def _short_tb(traceback: str, limit: int = 40) -> str:
    lines = strip_ansi(traceback).rstrip().splitlines()
    if len(lines) > limit:
        lines = lines[:8] + [f"    ... ({len(lines) - limit + 8} lines) ..."] + lines[-(limit - 9):]
    return "\n".join(lines)


def _first_line(s: str) -> str:
    lines = strip_ansi(s or "").strip().splitlines()
    return lines[0][:200] if lines else ""


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


#: exits that end a cell or script on a rank, not the rank's engine: one line each
_EXITS = {
    "SystemExit": lambda v: (f"exit() / sys.exit({'' if v in ('', 'None') else v}) ended the "
                             f"cell there; the engine keeps running, with its state"),
    "ScriptExit": lambda v: f"{v} (its output above says why); the engine keeps its state",
}


def _cont_of(note: str) -> str:
    """The command that continues a frozen rank, from its note ("its engine (PID 123)
    is stopped ...", or "(PID 123 on node2)" for another host's: run there)."""
    m = re.search(r"PID (\d+)(?: on ([^)\s]+))?\)", note or "")
    if not m:
        return "kill -CONT PID"
    return f"kill -CONT {m.group(1)}" + (f" on {m.group(2)}" if m.group(2) else "")


def _timed_out(evalue: str) -> bool:
    """A collective error that is gloo's, NCCL's or dpnb's check's group timeout."""
    return "timed out" in evalue.lower() or "timeout" in evalue.lower()


def _how_wait_ended(res: CellResult, evalue: str, timeout_s: float) -> str:
    """What ended a waiting rank's collective, from its own error: ``... until
    {this} it``."""
    if _timed_out(evalue):
        return f"the {timeout_s:g} s group timeout ended"
    if res.released:
        return "the release freed"
    if "interrupt" in evalue.lower():
        return (f"the interrupt at the cell's {res.cell_timeout_s:g} s timeout stopped"
                if res.cell_timeout_s else "the interrupt stopped")
    return "its peer's going away ended"


def _timed_out_line(res: CellResult, timed: list[int]) -> str:
    """Why ``timed`` were interrupted: the cell's own ``--timeout``, or (no
    cell timeout) because the peers waiting for them had given up."""
    was = "was" if len(timed) == 1 else "were"
    if res.cell_timeout_s:
        return (f"{rank_label(timed)} did not finish within the cell's {res.cell_timeout_s:g} s "
                f"timeout ({res.elapsed_s:.1f} s elapsed) and {was} interrupted")
    return (f"{rank_label(timed)} {was} still running after {res.elapsed_s:.1f} s when the ranks "
            f"waiting for {'it' if len(timed) == 1 else 'them'} gave up, and {was} interrupted "
            f"(no --timeout was given: the cell itself had no time limit)")


def error_report(res: CellResult, *, culprits: list[int], waiting: list[int],
                 timeout_s: float, reform_msg: str = "",
                 reformed: bool = False) -> tuple[str, str]:
    """``(summary, report)`` for a cell that failed on some ranks."""
    oc = res.outcomes
    lines: list[str] = []
    bits: list[str] = []
    for r in (r for r in res.ranks if oc[r].status == Status.DIED):
        lines.append(f"rank {r} died: {oc[r].died}")
        bits.append(f"rank {r} died")
    # Execution counts differ between ranks (``Cell In[7]`` vs ``In[9]``);
    # they must not split an otherwise identical failure.
    errs = {r: _CELL_NO.sub("Cell In[_]", f"{oc[r].ename}: {oc[r].evalue}\n"
                                          f"{strip_ansi(oc[r].traceback)}")
            for r in res.ranks if oc[r].status == Status.ERROR and r not in waiting}
    mism = [r for r in res.ranks if is_mismatch(oc[r])]
    if mism:
        lines.append("collective mismatch: " + mismatch_report(res, mism))
        bits.append(f"{rank_label(mism)} called different collectives")
        errs = {r: e for r, e in errs.items() if r not in mism}
    for ranks, _ in group_identical(errs):
        o = oc[ranks[0]]
        if o.ename in _EXITS:
            lines.append(f"{rank_label(ranks)}: {_EXITS[o.ename](o.evalue)}")
            bits.append(f"{rank_label(ranks)} exited the {'script' if o.ename == 'ScriptExit' else 'cell'}")
            continue
        where = user_line(o.traceback)
        head = f"{rank_label(ranks)} raised {o.ename}: {o.evalue}".rstrip(": ")
        lines.append(head + (f"\n    at {where}" if where else ""))
        tb = _short_tb(o.traceback)
        if tb:
            lines.append(_indent(tb))
        bits.append(f"{rank_label(ranks)} raised {o.ename}")
    timed = [r for r in res.ranks if oc[r].status == Status.TIMEOUT]
    if timed:
        lines.append(_timed_out_line(res, timed))
        bits.append(f"{rank_label(timed)} "
                    + ("timed out" if res.cell_timeout_s else "still busy when its peers gave up"))
    stuck = [r for r in res.ranks if oc[r].status == Status.DEADLOCKED]
    for r in stuck:
        lines.append(f"rank {r} could never complete its collective: {oc[r].note}")
    if stuck:
        bits.append(f"{rank_label(stuck)} blocked in a collective no rank could join")
    for r in (r for r in res.ranks if oc[r].status == Status.FROZEN):
        lines.append(f"rank {r} is frozen: {oc[r].note}.  It runs no code: its peers were "
                     f"released.  Continue it ({_cont_of(oc[r].note)}): its call then "
                     f"fails and the next cell re-forms the group, state kept; or %dp restart "
                     f"replaces it.")
        bits.append(f"rank {r} frozen")
    intr = [r for r in res.ranks if oc[r].status == Status.INTERRUPTED]
    if intr:
        lines.append(f"{rank_label(intr)} interrupted (Ctrl-C)")
        bits.append(f"{rank_label(intr)} interrupted")
    if waiting:
        on = rank_label(culprits) if culprits else "a peer"
        blocked = [r for r in waiting if oc[r].status != Status.STOPPED]
        if blocked:
            o = oc[blocked[0]]
            how = _how_wait_ended(res, o.evalue, timeout_s)
            lines.append(
                f"{rank_label(blocked)} {'was' if len(blocked) == 1 else 'were'} waiting on {on} "
                f"in a collective until {how} {'it' if len(blocked) == 1 else 'them'} "
                f"({o.ename}: {_first_line(o.evalue)})")
        stopped = [r for r in waiting if oc[r].status == Status.STOPPED]
        if stopped:
            lines.append(f"{rank_label(stopped)} {'was' if len(stopped) == 1 else 'were'} "
                         f"stopped (interrupted): {on} had failed, so the cell could not succeed")
        bits.append(f"{rank_label(waiting)} waiting on {on}")
    verdict = where_verdict(res)
    if verdict:
        lines.insert(0, "where: " + verdict)
    for n in cell_notes(res):  # calls paired across lines: why a value may be wrong
        lines.append(f"note: {n}")
    if res.released and res.elapsed_s < timeout_s:
        lines.append(f"The ranks' process groups were released, so the cell returned after "
                     f"{res.elapsed_s:.1f} s instead of at the {timeout_s:g} s group timeout.")
    elif res.released:  # the group timeout came first: no time was saved, say only what was done
        lines.append("The ranks' process groups were released, so no rank waits on.")
    if reform_msg:
        lines.append(reform_msg)
    summary = "; ".join(bits) or "the cell failed"
    if reformed:  # the flag the re-form returned, never a word read back from its message
        summary += " (process group re-formed, state kept)"
    return summary, "\n".join(lines)


def remote_error(res: CellResult, d: Diagnosis, *, timeout_s: float, reform_msg: str,
                 reformed: bool) -> RemoteCellError:
    """The :class:`RemoteCellError` for ``res`` once the group's fate is known."""
    summary, report = error_report(res, culprits=d.culprits, waiting=d.waiting,
                                   timeout_s=timeout_s, reform_msg=reform_msg,
                                   reformed=reformed)
    failures = {r: (o.ename, o.evalue, o.traceback)
                for r, o in res.outcomes.items() if o.status != Status.OK}
    return RemoteCellError(summary, report, failures=failures, waiting=d.waiting,
                           died=d.died, timed_out=d.timed_out, reformed=reformed)
