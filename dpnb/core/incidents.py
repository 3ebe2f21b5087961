"""What happened to a run: the faults the notebook saw, and how long each took to heal.

The runtime's :class:`dpnb.cluster.types.Health` is written by name when a
rank dies, the notebook stops waiting for a rank, the process group breaks
(a release, a death), a new group stands, or ranks are replaced; each write
that changes something also appends an :class:`Incident`.  :func:`rows`
pairs every fault with the first moment after it when every rank was alive
and the group usable -- its time to healthy -- for ``%dp incidents``.  Pure:
no torch, no IPython; times are the notebook's wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the kinds that are faults (the rest say how the cluster healed)
FAULTS = ("died", "still busy", "group broken")


@dataclass(frozen=True)
class Incident:
    """One change in the cluster's health, as the notebook saw it."""

    at: float  # time.time() when the notebook saw it
    kind: str  # "died", "still busy", "group broken", "healthy", "replaced", "resized"
    ranks: tuple[int, ...] = ()
    detail: str = ""


#: one step two ranks recorded within this many seconds is one step; further
#: apart, it was trained again (a roll-back to a snapshot), and both are kept
SAME_STEP_S = 0.5


def merge_steps(series) -> list[tuple]:
    """Step rows ``(step, t_end, loss, samples_per_s)`` from several sources (ranks,
    the notebook's kept copy) as one series in time order: a step seen twice
    within SAME_STEP_S is kept once."""
    rows = sorted(((int(s), float(t), float(lo), None if sps is None else float(sps))
                   for one in series for s, t, lo, sps in one), key=lambda r: r[1])
    last_at: dict[int, float] = {}
    out = []
    for row in rows:
        s, t = row[0], row[1]
        if s in last_at and t - last_at[s] <= SAME_STEP_S:
            continue
        last_at[s] = t
        out.append(row)
    return out


#: the most step rows a rank sends for ``%dp incidents`` (its series thinned evenly past it)
SERIES_MAX_POINTS = 4000
#: the most step rows the notebook keeps from replaced ranks (thinned evenly past it)
KEPT_STEPS_MAX = 20_000


def thin_steps(rows: list, most: int) -> tuple[tuple, ...]:
    """``rows`` thinned evenly to at most ``most`` (the last always kept)."""
    if len(rows) <= most or most < 2:
        return tuple(rows)
    stride = -(-len(rows) // (most - 1))
    out = rows[::stride]
    if (len(rows) - 1) % stride:
        out.append(rows[-1])
    return tuple(out)


@dataclass(frozen=True)
class RunLog:
    """What a view reads of what happened to a cluster (``ViewSource.run_log``): its
    incidents, the moment it started (their clock), the ranks alive and idle now
    (the ones a view may ask without waiting behind a call), and the steps the
    notebook kept from ranks before a restart or resize replaced them."""

    incidents: tuple[Incident, ...]
    started: float
    idle_ranks: tuple[int, ...]
    kept_steps: tuple[tuple, ...] = ()


@dataclass(frozen=True)
class IncidentRow:
    """A fault and how long until every rank was alive and the group usable again."""

    at_s: float  # seconds since the cluster started
    kind: str
    ranks: tuple[int, ...]
    detail: str
    healthy_after_s: float | None  # None: not healthy since


def rows(incidents: tuple[Incident, ...] | list[Incident], started: float) -> list[IncidentRow]:
    """One row per fault, with its time to healthy (the next ``healthy`` incident)."""
    out = []
    for i, inc in enumerate(incidents):
        if inc.kind not in FAULTS:
            continue
        healed = next((h.at for h in incidents[i + 1:] if h.kind == "healthy"), None)
        out.append(IncidentRow(max(0.0, inc.at - started), inc.kind, inc.ranks, inc.detail,
                               None if healed is None else max(0.0, healed - inc.at)))
    return out


def text(table: list[IncidentRow]) -> str:
    """The rows as the notebook prints them (one line each; "none" when nothing happened)."""
    if not table:
        return "no incidents: no rank died, no call was released, the group never broke"
    lines = []
    for r in table:
        who = ("rank " if len(r.ranks) == 1 else "ranks ") + ",".join(map(str, r.ranks)) \
            if r.ranks else "the group"
        healed = (f"healthy {r.healthy_after_s:.1f} s later" if r.healthy_after_s is not None
                  else "not healthy since")
        lines.append(f"{r.at_s:8.1f} s  {r.kind:<12} {who}: {r.detail or '-'} ({healed})")
    return "\n".join(lines)
