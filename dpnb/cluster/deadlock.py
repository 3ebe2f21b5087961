"""Certain deadlocks: ranks waiting in a collective that no rank can ever join.  Pure.

A rank blocked in a collective waits for every other member of its group; if
one of them has finished the cell (or never ran it: a ``--ranks`` cell), that
member will not call anything until the notebook sends more work, and the
notebook is waiting for the cell -- so the collective can never complete.
Likewise a ``recv`` (or an ``irecv`` waited on) whose sender has finished,
and a rank still waiting in dpnb's collective check for a peer that ran the
same call unchecked (see :class:`dpnb.engine.cell.collcheck.Pattern`).  When
*every* rank still running is in such a wait, nothing can change any more,
and the transport releases the group at once instead of waiting out the
group timeout.

A rank in plain Python code, in the debugger or not yet in any collective is
never counted: it may still call the collective the others wait for.
"""

from __future__ import annotations

from dpnb.engine.cell.collcheck import POINT_TO_POINT


def _members(coll: dict, world: int) -> set[int]:
    group = coll.get("group")
    return set(range(world)) if group is None else set(group)


def blocked_for_good(a: dict | None, rank: int, idle: set[int], answers: dict,
                     world: int) -> str | None:
    """Why rank ``rank`` (side-door answer ``a``) can never leave its collective,
    or None.  ``idle``: ranks not running the cell (finished, or not selected)."""
    if not a or a.get("debugger") or a.get("reporting"):
        return None
    c = a.get("collective")
    if not c:
        return None
    op = c.get("op")
    if op in POINT_TO_POINT:  # isend / irecv: waited on (their wait())
        peer = c.get("peer")
        peers = {peer} if peer is not None else set(range(world)) - {rank}
        if peers and peers <= idle:
            return f"its {op} peer, rank {', '.join(map(str, sorted(peers)))}, is not running the cell"
        return None
    absent = sorted((_members(c, world) - {rank}) & idle)
    if absent:
        who = "rank" if len(absent) == 1 else "ranks"
        return f"{who} {', '.join(map(str, absent))} of its group will not join it (not running the cell)"
    if c.get("phase") == "check":
        skipped = [r for r in (c.get("awaiting") or []) if _ran_unchecked(answers.get(r), c)]
        if skipped:
            return (f"it is checking call #{c.get('index')} while rank "
                    f"{', '.join(map(str, skipped))} runs that call without the check")
    elif c.get("index") is not None and c.get("group") is None:
        checking = [q for q, b in sorted(answers.items()) if q != rank
                    and _checks_waiting(b, c.get("index"))]
        if checking:
            return (f"it runs call #{c['index']} without the check while rank "
                    f"{', '.join(map(str, checking))} is still checking it")
    return None


def _checks_waiting(b: dict | None, index: int) -> bool:
    """Peer ``b`` waits in dpnb's check of call ``index`` (its verdict not in)."""
    bc = (b or {}).get("collective") or {}
    return bc.get("phase") == "check" and bc.get("index") == index and bool(bc.get("awaiting"))


def _ran_unchecked(b: dict | None, c: dict) -> bool:
    """Peer ``b`` is inside the same numbered default-group call, past the check."""
    bc = (b or {}).get("collective") or {}
    return bc.get("phase") == "run" and bc.get("index") is not None \
        and bc.get("index") == c.get("index") and bc.get("group") is None


def certain(answers: dict[int, dict | None], pending: set[int], world: int) -> dict[int, str]:
    """``{rank: why}`` when every pending rank is blocked for good; else ``{}``."""
    if not pending:
        return {}
    idle = set(range(world)) - pending
    out = {}
    for r in sorted(pending):
        why = blocked_for_good(answers.get(r), r, idle, answers, world)
        if why is None:
            return {}
        out[r] = why
    return out


def signature(answers: dict[int, dict | None], ranks: set[int]) -> tuple:
    """What must stay the same between two looks for a deadlock to count (the
    same call on every rank, not a new one that happens to look alike)."""
    out = []
    for r in sorted(ranks):
        c = (answers.get(r) or {}).get("collective") or {}
        out.append((r, c.get("op"), c.get("seq"), c.get("index"), c.get("phase")))
    return tuple(out)
