"""Starting, replacing, shrinking and probing engines: where the rank table changes.

The start (:meth:`dpnb.cluster.Engines.start`), a restart (the dead ranks'
engines replaced, :mod:`.restart`) and a resize (the highest ranks' engines
stopped, or engines added, :mod:`.world`) go through the same steps here:

1. the launcher starts ``k`` engines where it can place them
   (:mod:`.launchers`), and :func:`start_registered` waits until the
   controller has them (an agent that failed ends the wait with its stderr);
2. every new engine answers :func:`probe` (host, address, PID, GPUs);
3. the ranks are placed -- a replacement on its dead rank's host, with its
   local rank and device (:func:`place_replacements`); a new world afresh,
   contiguous per host (:func:`replan`);
4. the runtime takes the new rank table in one call
   (:meth:`dpnb.cluster.Engines.adopt_ranks`): the caller's, with the table
   these functions return.

Nothing here forms the process group; the caller does, once the table is right.
Each function takes only what it reads: the launcher (which holds the
ipyparallel cluster and client it started the engines with), the current
rank table, the backend and GPUs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..errors import StartError
from .gpuplan import GPU_PROBE_KEYS, choose_backend, with_devices
from .launch import controller_address
from .launchers import EngineLauncher
from .placement import assign_ranks
from .processes import engine_logs
from .spares import same_host
from .types import RankInfo, default_timeout

log = logging.getLogger(__name__)


def probe(client, icluster, eids: list[int]) -> dict[int, dict]:
    """``engine id -> probe`` (host, address, PID, GPUs) for ``eids``, asked at once."""
    from dpnb.engine import setup  # imports torch: only once engines are up

    if not eids:
        return {}
    return dict(zip(eids, client[eids].apply_sync(setup.probe, controller_address(icluster))))


def probe_some(client, icluster, eids: list[int], within_s: float,
               enough: Callable[[dict[int, dict]], bool]) -> tuple[dict[int, dict], bool]:
    """:func:`probe` for engines that may be dead (a spare's engine, still listed
    after its process died): the answers once ``enough(answers)`` holds, or all
    came, or ``within_s`` passed; and whether it waited for all (``complete``)."""
    from dpnb.engine import setup  # imports torch: only once engines are up

    asked = {e: client[e].apply_async(setup.probe, controller_address(icluster)) for e in eids}
    deadline = time.monotonic() + within_s
    out: dict[int, dict] = {}
    while True:
        for e, ar in list(asked.items()):
            if ar.ready():
                del asked[e]
                try:
                    out[e] = ar.get(0)
                except Exception as ex:  # the caller names the silent ones; this says why
                    log.info("engine %s failed its probe: %s: %s", e, type(ex).__name__, ex)
        if not asked or time.monotonic() > deadline:
            return out, True
        if enough(out):
            return out, False
        time.sleep(0.005)


def start_registered(launcher: EngineLauncher, ranks: Sequence[RankInfo], k: int,
                     start: Callable[[], dict | None]) -> list[int]:
    """Run ``start`` (a launcher's ``start_more`` / ``start_replacements``); the ids
    of the ``k`` engines it brought, once the controller has them."""
    known = set(launcher.client.ids) | {ri.engine_id for ri in ranks}
    return wait_new(launcher, known, k, start())


def replace(launcher: EngineLauncher, table: Sequence[RankInfo],
            ranks: list[int]) -> tuple[list[RankInfo], tuple[int, ...]]:
    """Engines for ``ranks``: the rank table with them holding those numbers, and
    which of ``ranks`` got a spare (:mod:`.spares`, ``--spares``) rather than an
    engine started now.

    A replacement takes the dead rank's host, local rank and device.  On ssh
    clusters it is started by that host's agent, so it lands there; other
    launchers place it themselves, and one that lands on another host is
    refused rather than given a local rank (a GPU) another rank holds.
    """
    spares = launcher.spares
    taken = spares.take(launcher.client, table, ranks, lambda eids, s, enough: probe_some(
        launcher.client, launcher.ipp, eids, s, enough)) if spares else None
    cold = [r for r in ranks if not taken or r not in taken.ranks]
    new = start_registered(launcher, table, len(cold),
                           lambda: launcher.start_replacements(table, cold)) if cold else []
    probes = {**(taken.probes if taken else {}), **probe(launcher.client, launcher.ipp, new)}
    try:
        out = place_replacements(list(table), ranks, probes)
    except StartError:
        launcher.client.shutdown(targets=list(probes), block=False)  # nothing may hold a rank twice
        raise
    if spares:  # the next spares come up while the group re-forms and training goes on
        spares.fill({out[r].location for r in ranks})
    return out, taken.ranks if taken else ()


def wait_new(launcher: EngineLauncher, known: set, k: int, started: dict | None,
             timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        new = sorted(set(launcher.client.ids) - known)
        if len(new) >= k:
            return new[:k]
        bad = launcher.agents.failures(started) if started is not None else []
        if time.monotonic() > deadline or bad:
            raise StartError(f"replacement engines: {len(new)} of {k} registered within "
                             f"{timeout:.0f} s{engine_logs(launcher.ipp)}\n" + "\n".join(bad))
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
        match = next((r for r in todo if same_host(old[r], p)), None)
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
                              device_fallback=o.device_fallback, own_gpu=o.own_gpu)
    return out


def replan(launcher: EngineLauncher, backend: str, gpus: list[int] | None,
           keep: Sequence[RankInfo], added_eids: list[int], m: int) -> list[RankInfo]:
    """The rank table of a new world of ``m``: the survivors ``keep`` in their order
    (their rank as the key), new engines after their host's survivors, hosts new
    to the cluster last; devices planned again (under NCCL from the survivors'
    fresh view of the GPUs)."""
    probes = {ri.engine_id: {"host": ri.host, "ip": ri.ip, "pid": ri.pid, "launch_rank": ri.rank,
                             "location": ri.location, "ifname": ri.ifname} for ri in keep}
    if backend == "nccl":
        seen = probe(launcher.client, launcher.ipp, [ri.engine_id for ri in keep])
        for ri in keep:
            probes[ri.engine_id].update({k: seen[ri.engine_id].get(k) for k in GPU_PROBE_KEYS})
    last = {ri.host: ri.rank for ri in keep}
    for eid, p in probe(launcher.client, launcher.ipp, added_eids).items():
        p["launch_rank"] = (last.get(p["host"], len(keep) + m) + 0.5 + eid / 1e9)
        probes[eid] = p
    return with_devices(assign_ranks(probes, by_launch_rank=True), backend, gpus, probes)


def plan_world(client, icluster, n: int, starter: EngineLauncher, *, backend: str, gpus,
               timeout: float | None, threads: int | None):
    """The first ``n`` engines probed and placed: ``(ranks, backend, timeout, threads)``
    -- ranks by host as the launcher orders them, each with its device; the backend
    (``auto`` resolved), torch's group timeout for it unless given, and torch threads
    per rank so that a host's ranks share its cores (unless given)."""
    eids = sorted(client.ids)[:n]
    probes = probe(client, icluster, eids)
    ranks = assign_ranks(probes, **starter.rank_order(n))
    backend = choose_backend(backend, ranks, probes, gpus)
    timeout = default_timeout(backend) if timeout is None else timeout
    ranks = with_devices(ranks, backend, gpus, probes)
    if threads is None:
        cpu = min(probes[e]["cpu_count"] for e in eids)
        threads = max(1, cpu // max(r.local_world_size for r in ranks))
    return ranks, backend, timeout, threads
