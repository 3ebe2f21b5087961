"""A stand-in for a cluster as :class:`dpnb.cluster.publish.Publication` reads it
(ranks, health, last failure): the sidebar's records without a cluster, for
tests/unit/test_lab_records.py and the server's tests."""

import dataclasses
import time
from types import SimpleNamespace

from dpnb.cluster import publish
from dpnb.cluster.types import RankInfo


def _rank(r: int, pid: int) -> RankInfo:
    return RankInfo(rank=r, engine_id=r, host="h1", ip="127.0.0.1", pid=pid, local_rank=r,
                    local_world_size=2, node_rank=0, device="cpu")


class _Stand(SimpleNamespace):
    """What a Publication reads of an Engines (held weakly, as the real one)."""


def _cluster(pid: int, **kw) -> _Stand:
    return _Stand(cluster_id="1700000000-abcd", ranks=[_rank(0, pid), _rank(1, pid)],
                           local=True, dead={}, profile_dir="/p", created=time.time(),
                           backend="gloo", launcher="local", keep_s=None, generation=1,
                           group_ok=True, last_failure=None, running=True,
                           **{"agent_door": None, **kw})


def _cuda_publication(pid):
    c = _cluster(pid)
    c.cluster_id, c.ranks[0] = "1700000002-cuda", dataclasses.replace(c.ranks[0], device="cuda:0")
    return publish.Publication(c, period_s=60)
