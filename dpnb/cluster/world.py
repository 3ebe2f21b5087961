"""Changing how many ranks a running cluster has: stop or add engines, re-form.

``%dp resize -n M`` (see :mod:`dpnb.session.resize` for the training side) ends here
with the engine work: the highest ranks' engines are stopped (shrink) or new
engines are started where the launcher can place them (grow); every engine
left is given its rank again -- ranks stay contiguous per host, like torchrun
-- and one new process group of ``M`` ranks is formed.  Nothing is re-bound
to the new group here: a wrapped model bound to ``N`` ranks cannot be
re-bound to ``M``; the training layer rebuilds it from a checkpoint.
Survivors keep their namespaces.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..errors import DpnbError
from .gpuplan import GPU_PROBE_KEYS, with_devices
from .placement import assign_ranks
from .restart import wait_new

if TYPE_CHECKING:  # pragma: no cover
    from . import Engines as Cluster

log = logging.getLogger(__name__)

def capacity(c: Cluster) -> tuple[int, str]:
    """How many ranks this cluster's launcher can place, and why that many."""
    return c.engine_launcher.capacity(c)


def check_target(c: Cluster, m) -> None:
    """One-line errors for a target this cluster cannot take; changes nothing."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise DpnbError(f"-n must be a whole number of ranks >= 1 (got {m!r}); to end the job "
                        f"use %dp stop")
    if m == c.world_size:
        raise DpnbError(f"the cluster already has {m} ranks: nothing to resize")
    cap, why = capacity(c)
    if m > cap:
        raise DpnbError(f"-n {m} is more ranks than the {c.launcher} launcher can place here "
                        f"(at most {cap}: {why}); resize to {cap} or fewer")


def _start_more(c: Cluster, k: int) -> list[int]:
    """Start ``k`` engines where the launcher can place them; their engine ids once registered."""
    known = set(c.client.ids) | {ri.engine_id for ri in c.ranks}
    return wait_new(c, known, k, c.engine_launcher.start_more(c, k))


def _stop_ranks(c: Cluster, ranks: list[int]) -> None:
    """Stop the engines of ``ranks``: by PID here (``kill_rank`` waits until each
    is reaped), through their host's agent, or through ipyparallel."""
    for r in ranks:
        c.kill_rank(r)


def resize_world(c: Cluster, m: int) -> dict:
    """Stop or add engines so that ``m`` ranks remain, then form their group.

    Returns ``{"old", "new", "added", "removed"}`` (rank numbers).  Ranks are
    assigned afresh from the engines' hosts (contiguous per host); on one
    host the survivors keep their numbers.
    """
    from ..engine import setup
    from .launch import controller_address

    check_target(c, m)
    n = c.world_size
    removed, added_eids = [], []
    if m < n:
        removed = list(range(m, n))
        _stop_ranks(c, removed)
        keep = c.ranks[:m]
    else:
        keep = list(c.ranks)
        added_eids = _start_more(c, m - n)
    # survivors keep their order (their rank as the key); new engines follow,
    # each after its host's survivors, hosts new to the cluster last
    probes = {ri.engine_id: {"host": ri.host, "ip": ri.ip, "pid": ri.pid, "launch_rank": ri.rank,
                             "location": ri.location, "ifname": ri.ifname} for ri in keep}
    if c.backend == "nccl":  # the survivors' view of the GPUs, for the device plan
        seen = c.client[[ri.engine_id for ri in keep]].apply_sync(setup.probe,
                                                                 controller_address(c._ipp))
        for ri, p in zip(keep, seen):
            probes[ri.engine_id].update({k: p.get(k) for k in GPU_PROBE_KEYS})
    if added_eids:
        fresh = c.client[added_eids].apply_sync(setup.probe, controller_address(c._ipp))
        last = {ri.host: ri.rank for ri in keep}
        for eid, p in zip(added_eids, fresh):
            p["launch_rank"] = (last.get(p["host"], len(keep) + m) + 0.5 + eid / 1e9)
            probes[eid] = p
    ranks = with_devices(assign_ranks(probes, by_launch_rank=True), c.backend, c.gpus, probes)
    c.ranks[:] = ranks
    added = [ri.rank for ri in ranks if ri.engine_id in added_eids]
    for r in list(c.transport.doors):
        if r >= m:
            c.transport.doors.pop(r)
    c.health.dead.clear()
    c.health.busy.clear()
    if c.local:  # threads per engine follow the engines per core, as at start
        per_host = max(ri.local_world_size for ri in ranks)
        c.group.threads = max(1, (os.cpu_count() or 1) // per_host)
    c.procs.remember(c.ranks)
    c.procs.write_reaper_file(c.ranks)
    c.group.init_ranks(new=added)
    c.group.regroup(callbacks=False, hint="; try %dp restart --hard")
    log.info("resized from %d to %d ranks (added %s, removed %s)", n, m, added, removed)
    return {"old": n, "new": m, "added": added, "removed": removed}
