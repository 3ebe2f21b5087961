"""Spare engines: started and registered ahead of a fault, so a restart need not wait.

A dead rank's replacement is an engine its host's agent forks: measured in the
storm benchmark (``benchmarks/RESULTS.md``), about 1 s of a 2.4 s ``restart
--resume`` on an ssh host went to that engine building its IPython kernel,
registering with the controller and being seen to beat -- while every
survivor waited.  ``%dp start --spares K`` (``dpnb.start(spares=K)``) has each
host's agent keep K more engines than the host's ranks, registered and idle:
a restart gives a dead rank its host's spare (one probe, milliseconds) and
asks the agent for the next spare at once, which comes up while the group
re-forms and training goes on.

Who says what, when:

* the **agent** forks a spare when asked (one request over its pipe, answered
  with the PID; the spare registers with the controller by itself);
* the **kernel** learns a spare's engine id only when a restart needs one:
  the controller's engines that never held a rank (:attr:`Spares.seen` holds
  every id that did, each rank table being noted as it is adopted) are
  probed -- host, PID -- and matched to the spares' PIDs; an id that does not
  answer within :data:`PROBE_S` (a spare that died and is not yet
  unregistered) is never asked again;
* a spare never runs a cell and never joins the group until it is given a
  rank; it ends with its agent, as the ranks do (the agent stops every
  engine it forked; each watches the agent).

Only launchers whose agents fork engines keep spares (local and ssh); a
spare lives on its host, so it replaces only a rank of that host.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .types import RankInfo

log = logging.getLogger(__name__)

#: how long the registered spares are given to answer their probe (a live
#: idle engine answers in milliseconds)
PROBE_S = 3.0
#: how long a restart waits for a spare still registering (forked moments
#: before, by the restart just before it) rather than starting another engine
REGISTER_WAIT_S = 10.0


@dataclass(frozen=True)
class Taken:
    """Spares given to dead ranks: ``probes`` (engine id -> its probe, as
    :func:`dpnb.cluster.engines.probe` returns) and the ranks they cover."""

    probes: dict[int, dict]
    ranks: tuple[int, ...]


def same_host(ri: RankInfo, p: dict) -> bool:
    """Whether the engine that answered ``p`` lives where rank ``ri`` lived: the
    agent's location when there is one, else the host name (a replacement's
    placement, :func:`dpnb.cluster.engines.place_replacements`, and a spare's)."""
    return (ri.location == p.get("location")) if ri.location else ri.host == p["host"]


class Spares:
    """The spare engines of one cluster, ``per_host`` on each of its hosts.

    ``fork(counts)`` asks the agents for engines (``{location: k}`` -> ``{location:
    [pid, ...]}``); ``alive(location, pid)`` says whether the agent still sees it
    run.  Both are the launcher's agents', passed in so this class holds no
    connection of its own.
    """

    def __init__(self, per_host: int, fork: Callable[[dict[str, int]], dict[str, list[int]]],
                 alive: Callable[[str, int], bool]):
        self.per_host = per_host
        self._fork, self._alive = fork, alive
        self.pool: dict[str, list[int]] = {}  # location -> PIDs of its spares
        self.forked_at: dict[tuple[str, int], float] = {}  # (location, PID) -> monotonic
        self.seen: set[int] = set()  # engine ids that held a rank, or never answered

    # ------------------------------------------------------------------ book
    def saw(self, ranks: Iterable[RankInfo]) -> None:
        """Note a rank table: its engines are ranks, never spares."""
        self.seen |= {ri.engine_id for ri in ranks}

    def count(self) -> dict[str, int]:
        """``{location: live spares}``."""
        return {loc: len(self._live(loc)) for loc in self.pool}

    def describe(self) -> str:
        """One line for ``%dp status``: the live spares of each host."""
        each = ", ".join(f"{k} on {loc}" for loc, k in sorted(self.count().items()))
        return (f"spare engines: {each or 'none yet'} (a restart gives a dead rank its "
                f"host's spare; {self.per_host} per host kept)")

    def _live(self, loc: str) -> list[int]:
        self.pool[loc] = [pid for pid in self.pool.get(loc, []) if self._alive(loc, pid)]
        # a spare that left the pool (taken, dead, lost) needs no fork time any more
        self.forked_at = {k: t for k, t in self.forked_at.items()
                          if k[0] != loc or k[1] in self.pool[loc]}
        return self.pool[loc]

    def fill(self, locations: Iterable[str]) -> dict[str, list[int]]:
        """Ask each of ``locations``' agents for the spares it lacks; what was forked.
        A host whose agent cannot fork is logged and left without (a spare is
        an optimisation: the next restart starts its engine as before)."""
        want = {loc: self.per_host - len(self._live(loc)) for loc in set(locations)}
        want = {loc: k for loc, k in want.items() if k > 0}
        if not want:
            return {}
        try:
            got = self._fork(want)
        except Exception as e:  # the restart itself succeeded; say why none is spare
            log.warning("no spare engine started on %s: %s: %s", ", ".join(sorted(want)),
                        type(e).__name__, e)
            return {}
        now = time.monotonic()
        for loc, pids in got.items():
            self.pool.setdefault(loc, []).extend(pids)
            self.forked_at.update({(loc, pid): now for pid in pids})
        return got

    # ------------------------------------------------------------------ take
    def take(self, client, table: Sequence[RankInfo], dead: Sequence[int],
             probe: Callable[..., tuple[dict[int, dict], bool]]) -> Taken:
        """Spares for as many of ``dead`` as their hosts have: their probes and the
        ranks they cover (each spare leaves the pool and counts as seen).

        ``probe(eids, within_s, enough)`` asks engines for their probe and answers
        ``(probes, complete)``: it stops once ``enough(probes so far)`` -- each
        dead rank's host has answered with its spares (a spare that just died
        with its host's ranks stays listed, silent, until the controller
        misses its heartbeats: it is not waited for) -- or once every engine
        answered or ``within_s`` passed (``complete``: the silent ones are
        dead, and never asked again).  A spare still registering is waited
        for (up to :data:`REGISTER_WAIT_S`): a restart right after another
        would otherwise start an engine while the spare registers, and take
        the one that registers first, wherever it lives."""
        self.saw(table)
        want = collections.Counter(table[r].location or table[r].host for r in dead)
        if not any(self._live(loc) for loc in want if loc in self.pool):
            return Taken({}, ())
        live = [(loc, pid) for loc in list(self.pool) for pid in self._live(loc)]
        # a spare forked less than REGISTER_WAIT_S ago may still be registering
        deadline = max(self.forked_at.get(k, 0.0) for k in live) + REGISTER_WAIT_S
        while True:
            candidates = sorted(set(client.ids) - self.seen)
            if len(candidates) >= len(live) or time.monotonic() > deadline:
                break
            time.sleep(0.05)

        def enough(answered: dict[int, dict]) -> bool:
            # every dead rank's host has answered with as many spares as it has (live)
            mine = collections.Counter(p.get("location", "") for p in answered.values()
                                       if p.get("pid") in self.pool.get(p.get("location", ""), ()))
            return all(mine[loc] >= min(k, len(self.pool.get(loc, ()))) for loc, k in want.items())

        probes, complete = probe(candidates, PROBE_S, enough) if candidates else ({}, True)
        if complete:  # every candidate answered, or PROBE_S passed: the silent are dead
            silent = set(candidates) - set(probes)
            if silent:
                log.warning("engines %s registered with the controller but did not answer "
                            "within %.0f s: not used as spares", sorted(silent), PROBE_S)
                self.seen |= silent
            self._drop_lost(probes, live)
        return self._match(table, dead, probes)

    def _drop_lost(self, probes: dict[int, dict], live: list[tuple[str, int]]) -> None:
        """Spares that did not answer long after their fork (never registered, or
        silent) leave the pool, so that the next fill replaces them; their agent
        stops them with the cluster."""
        answered = {(p.get("location", ""), p.get("pid")) for p in probes.values()}
        late = time.monotonic() - REGISTER_WAIT_S
        for loc, pid in live:
            if (loc, pid) not in answered and self.forked_at.get((loc, pid), 0.0) < late:
                log.warning("spare engine PID %s on %s never answered: not used", pid, loc)
                self.pool[loc].remove(pid)

    def _match(self, table: Sequence[RankInfo], dead: Sequence[int],
               probes: dict[int, dict]) -> Taken:
        # a spare is known by its agent's location and its PID there (two hosts'
        # PID spaces are their own)
        free = {eid: p for eid, p in probes.items()
                if p.get("pid") in self.pool.get(p.get("location", ""), [])}
        out: dict[int, dict] = {}
        covered = []
        for r in dead:
            eid = next((e for e, p in sorted(free.items()) if same_host(table[r], p)), None)
            if eid is None:
                continue
            p = out[eid] = free.pop(eid)
            self.pool[p["location"]].remove(p["pid"])
            self.seen.add(eid)
            covered.append(r)
        return Taken(out, tuple(covered))
