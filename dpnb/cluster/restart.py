"""Bringing the world back: replace dead engines and re-form the group.

A replacement engine takes the dead rank's number (and its local rank and
device) and starts empty; survivors keep their namespaces.  State changes only
once the step that justifies it succeeded: a rank stops counting as dead when
its replacement is probed, busy marks go when the group is re-formed.

``restart --resume`` (rebuild the model on the replaced ranks and load a
checkpoint) is the training session's (:mod:`dpnb.session.resume`): it asks
this module which ranks were replaced.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.cellgraph import cell_summary
from ..errors import StartError
from ..ranks import rank_label
from .diagnose import kept
from .processes import engine_logs
from .types import SETUP_LOG_MAX, RankInfo, SetupEntry

if TYPE_CHECKING:  # pragma: no cover
    from . import Engines as Cluster

log = logging.getLogger(__name__)


class SetupLog:
    """What built the ranks' state, replayed by ``restart --resume``; bounded."""

    def __init__(self, limit: int = SETUP_LOG_MAX):
        self.entries: collections.deque[SetupEntry] = collections.deque(maxlen=limit)
        self.dropped = 0

    def _add(self, e: SetupEntry) -> None:
        if len(self.entries) == self.entries.maxlen:
            self.dropped += 1
            log.warning("setup log full (%d entries): dropping the oldest", self.entries.maxlen)
        self.entries.append(e)

    def add_cell(self, code: str) -> None:
        self._add(SetupEntry(kind="cell", label=f"cell: {cell_summary(code)}", code=code))

    def add_call(self, label: str, dotted: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self._add(SetupEntry(kind="call", label=label, dotted=dotted, args=tuple(args),
                             kwargs=dict(kwargs or {})))

    def has_call(self, dotted: str) -> bool:
        return any(e.dotted == dotted for e in self.entries)

    def describe(self) -> list[str]:
        out = [f"{i + 1}. {e.label}" for i, e in enumerate(self.entries)]
        if self.dropped:
            out.insert(0, f"({self.dropped} older entries were dropped: the log keeps "
                          f"{self.entries.maxlen})")
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.entries)


def replace_engines(c: Cluster, ranks: list[int]) -> None:
    """Start ``len(ranks)`` engines and give them the numbers of ``ranks``.

    A replacement takes the dead rank's host, local rank and device.  On ssh
    clusters it is started by that host's agent, so it lands there; other
    launchers place it themselves, and one that lands on another host is
    refused rather than given a local rank (a GPU) another rank holds.
    """
    known = set(c.client.ids) | {ri.engine_id for ri in c.ranks}
    started = c.engine_launcher.start_replacements(c, ranks)
    new = wait_new(c, known, len(ranks), started)
    from ..engine import setup
    from .launch import controller_address

    probes = dict(zip(new, c.client[new].apply_sync(setup.probe, controller_address(c._ipp))))
    try:
        c.ranks[:] = place_replacements(c.ranks, ranks, probes)
    except StartError:
        c.client.shutdown(targets=new, block=False)  # nothing may hold a rank twice
        raise
    for r in ranks:
        c.health.dead.pop(r, None)  # a live engine holds the rank now
        c.transport.doors.pop(r, None)  # the old engine's door; init_rank opens a new one
    c.procs.remember(c.ranks)
    c.procs.write_reaper_file(c.ranks)


def wait_new(c: Cluster, known: set, k: int, started: dict | None,
              timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        new = sorted(set(c.client.ids) - known)
        if len(new) >= k:
            return new[:k]
        bad = c.agents.failures(started) if started is not None else []
        if time.monotonic() > deadline or bad:
            raise StartError(f"replacement engines: {len(new)} of {k} registered within "
                             f"{timeout:.0f} s{engine_logs(c._ipp)}\n" + "\n".join(bad))
        time.sleep(0.05)


def place_replacements(old: list[RankInfo], ranks: list[int],
                       probes: dict[int, dict]) -> list[RankInfo]:
    """The rank table with each of ``ranks`` held by one of the new engines in ``probes``.

    A replacement goes to a dead rank of its own host (matched by the agent's
    location when there is one, else by hostname) and keeps that rank's local
    rank and device.  When a new engine's host had no dead rank, the placement
    is refused with what happened, instead of doubling a local rank.
    """
    out = list(old)
    todo = list(ranks)
    for eid, p in sorted(probes.items()):
        def same_host(r: int) -> bool:
            ri = old[r]
            return (ri.location == p.get("location")) if ri.location else ri.host == p["host"]

        match = next((r for r in todo if same_host(r)), None)
        if match is None:
            where = ", ".join(f"rank {r} on {old[r].host}" for r in todo)
            raise StartError(
                f"the launcher started a replacement on {p['host']}, but the dead ranks lived "
                f"elsewhere ({where}): putting it on {p['host']} would give two ranks the same "
                f"local rank (and device) there. Run %dp restart --hard, or stop and start "
                f"the cluster")
        todo.remove(match)
        o = old[match]
        out[match] = RankInfo(rank=match, engine_id=eid, host=p["host"], ip=p["ip"],
                              pid=p["pid"], local_rank=o.local_rank,
                              local_world_size=o.local_world_size, node_rank=o.node_rank,
                              device=o.device, location=o.location,
                              ifname=p.get("ifname", o.ifname),
                              visible_devices=o.visible_devices,
                              device_fallback=o.device_fallback)
    return out


def _settle_busy(c: Cluster, hard: bool) -> None:
    """Interrupt survivors still running an old cell; kill those that do not stop."""
    h = c.health
    busy = [r for r in h.busy if r not in h.dead]
    if not busy or hard:
        return
    c.transport.interrupt(busy)
    deadline = time.monotonic() + c.timeout_s + 10
    while time.monotonic() < deadline:
        c.transport.refresh_busy()
        if not [r for r in h.busy if r not in h.dead]:
            return
        time.sleep(0.2)
    for r in sorted(r for r in h.busy if r not in h.dead):
        c.kill_rank(r)
        h.dead[r] = "killed by restart: it did not respond to interrupts"


@dataclass(frozen=True)
class Restarted:
    """What a restart did: the ranks given fresh engines, and the sentence saying so."""

    replaced: tuple[int, ...]
    message: str


def restart(c: Cluster, *, hard: bool = False) -> Restarted:
    """See :meth:`dpnb.cluster.Engines.restart`."""
    c.require_running()
    c.transport.refresh_busy()
    _settle_busy(c, hard)
    h = c.health
    h.dead.update(c.transport.find_dead([r for r in range(c.world_size) if r not in h.dead]))
    replace = list(range(c.world_size)) if hard else sorted(h.dead)
    if hard:
        for r in replace:
            if r not in h.dead:
                c.kill_rank(r)
    if replace:
        replace_engines(c, replace)
    info = c.group.reform_all(new=replace)
    h.busy.clear()  # every rank took part in the new group: none is running an old cell
    keep = [r for r in range(c.world_size) if r not in replace]
    msg = f"World back to {c.world_size} ranks, process group re-formed on port {c.master_port}."
    if replace:
        msg += f" {rank_label(replace)} replaced: everything defined there was lost."
    if keep:
        msg += f" {kept(keep)}."
    if info.get("problems"):
        msg += " Not re-bound: " + "; ".join(info["problems"])
    return Restarted(tuple(replace), msg)
