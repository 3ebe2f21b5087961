"""Which engine is which rank: hosts in the order the user gave them, ranks contiguous per host.

The engines register with the controller in whatever order their hosts are
fast; the ranks must not follow that.  torchrun numbers nodes by
``--node-rank``, Slurm by its nodelist, ``mpirun`` by its hostfile; dpnb
follows the same orders (each launcher's ``rank_order``, :mod:`dpnb.cluster.launchers`), so rank 0 -- the store,
checkpoints, the exported job's first node -- is on the same host every start.
Pure: probes in, typed ranks out.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ranks import rank_label
from .types import RankInfo


def _engine_order(probes: dict[int, dict], host_order: Sequence[str] | None,
                  by_launch_rank: bool) -> list[int]:
    """Engine ids in rank order: by the launcher's own rank (Slurm's task id, MPI's
    world rank: nodelist / hostfile order) when every engine has a distinct one;
    else hosts in ``host_order`` (ssh destinations, as the user listed them), and
    engine id within a host; else by engine id (one host: local)."""
    eids = sorted(probes)
    launch = [probes[e].get("launch_rank") for e in eids]
    if by_launch_rank and None not in launch and len(set(launch)) == len(launch):
        return sorted(eids, key=lambda e: probes[e]["launch_rank"])
    if host_order:
        pos = {h: i for i, h in enumerate(host_order)}
        far = len(pos)
        return sorted(eids, key=lambda e: (pos.get(probes[e].get("location") or "", far), e))
    return eids


def assign_ranks(probes: dict[int, dict], host_order: Sequence[str] | None = None,
                 by_launch_rank: bool = False) -> list[RankInfo]:
    """Ranks contiguous per host, hosts in the order the user gave them.

    This is torchrun's layout: ``rank = node_rank * local_world_size +
    local_rank`` when hosts run equal numbers of engines, and local rank (and
    so the GPU) comes from the position among the engines on the same host.
    The host order is the user's -- the ssh ``HOST=N`` arguments in order,
    Slurm's nodelist, MPI's hostfile (see :func:`_engine_order`) -- never
    whichever host's engines registered first, so rank 0 (checkpoints, the
    store, the exported job's first node) is on the same host every start.
    """
    by_host: dict[str, list[int]] = {}
    for eid in _engine_order(probes, host_order, by_launch_rank):
        by_host.setdefault(probes[eid]["host"], []).append(eid)
    ranks: list[RankInfo] = []
    for node_rank, (host, eids) in enumerate(by_host.items()):
        for local_rank, eid in enumerate(eids):
            p = probes[eid]
            ranks.append(RankInfo(rank=len(ranks), engine_id=eid, host=host, ip=p["ip"],
                                  pid=p["pid"], local_rank=local_rank,
                                  local_world_size=len(eids), node_rank=node_rank, device="",
                                  location=p.get("location", ""), ifname=p.get("ifname", "")))
    return ranks


def host_layout(ranks: Sequence[RankInfo]) -> str:
    """``node-a: ranks 0-1, node-b: ranks 2-3`` (hosts in rank order)."""
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(r.host, []).append(r.rank)
    return ", ".join(f"{h}: {rank_label(rs)}" for h, rs in by_host.items())
