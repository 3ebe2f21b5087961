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
