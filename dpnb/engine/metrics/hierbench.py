"""Flat vs two-level all-reduce on the live ranks, and each link on its own (collective).

The distributed story.  A flat ring all-reduce over all N = nodes × g ranks
sends 2(N−1)/N of the buffer S from every rank, and some hops of the ring
cross hosts, so every step waits for the slow inter-host link.  The
two-level (hierarchical) all-reduce of Horovod and NCCL's trees keeps most
traffic inside a host:

1. reduce-scatter S inside each host (the g ranks of a host; fast link):
   local rank i ends with shard i of its host's sum, S/g bytes;
2. all-reduce each shard across hosts, among the ranks with the same local
   rank (``nodes`` ranks per group, the g groups at once; slow link, but
   only S/g per rank);
3. all-gather inside each host: every rank ends with the whole sum.

Every rank calls :func:`bench_hierarchical` with the same arguments.  It
forms two sets of subgroups the first time (one per host, one per local
rank; ``new_group`` is itself collective, and every rank creates every group
in the same order), then per message size times: the flat all-reduce on the
default group; each phase of the two-level one; and each link alone -- an
all-reduce of S inside every host at once (the intra-host link) and of S/g
across hosts on every local-rank group at once (the inter-host link as each
rank sees it while its host's g ranks share it).  The notebook fits α and β
of each link to those and sets the model
(:func:`dpnb.core.hierarchical_allreduce_time`) beside the measured times.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dpnb.engine import device
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import ViewError

PHASES = ("flat", "intra", "inter", "reduce_scatter", "all_reduce", "all_gather", "two_level")


def check_layout(hosts: list, world_size: int) -> tuple[list[list[int]], int]:
    """Ranks per host from ``hosts`` (the host index of each rank): ``(members, g)``.

    The two-level algorithm needs at least two hosts with the same number of
    ranks on each (one inter-host group per local rank).
    """
    if len(hosts) != world_size:
        raise ViewError(f"host layout names {len(hosts)} ranks but the world has {world_size}")
    members: dict = {}
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(r)
    groups = list(members.values())
    sizes = sorted({len(m) for m in groups})
    if len(groups) < 2:
        raise ViewError(f"all {world_size} ranks are on one host: a two-level all-reduce needs "
                        "two or more hosts (on one machine, pretend with %dp bench hierarchical --hosts K)")
    if len(sizes) > 1:
        raise ViewError("hosts run different numbers of ranks ("
                        + ", ".join(f"host {h}: {len(m)}" for h, m in members.items())
                        + "): a two-level all-reduce needs the same number on every host")
    return groups, sizes[0]


def _subgroups(es, hosts: list):
    """This rank's (intra-host group, inter-host group), formed once per group generation."""
    key = (es.generation, tuple(hosts))
    if es.subgroups is not None and es.subgroups[0] == key:
        return es.subgroups[1], es.subgroups[2]
    members, g = check_layout(hosts, es.world_size)
    timeout = timedelta(seconds=es.timeout_s)
    intra = inter = None
    for m in members:  # collective: every rank creates every group, in the same order
        pg = dist.new_group(m, timeout=timeout)
        if es.rank in m:
            intra = pg
    for i in range(g):
        ranks = [m[i] for m in members]
        pg = dist.new_group(ranks, timeout=timeout)
        if es.rank in ranks:
            inter = pg
    es.subgroups = (key, intra, inter)
    return intra, inter


def _timed(op, t, group, dev) -> float:
    """One collective on ``group``, every rank starting together (a barrier first)."""
    dist.barrier()
    device.synchronize(dev)
    t0 = time.perf_counter()
    op(t, group=group)
    device.synchronize(dev)
    return time.perf_counter() - t0


def _two_level(full, shard, intra, inter, dev) -> list[float]:
    """Intra-host reduce-scatter, inter-host all-reduce of the shard, intra-host
    all-gather (``full`` ends as the sum over every rank); each phase's seconds."""
    marks = [time.perf_counter()]
    dist.reduce_scatter_single(shard, full, group=intra)
    device.synchronize(dev)
    marks.append(time.perf_counter())
    dist.all_reduce(shard, group=inter)
    device.synchronize(dev)
    marks.append(time.perf_counter())
    dist.all_gather_single(full, shard, group=intra)
    device.synchronize(dev)
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def bench_hierarchical(ns: dict, sizes: list, hosts: list, iters: int = 3, warmup: int = 1) -> dict:
    """Time flat and two-level all-reduce, and each link alone, per size (collective).

    ``hosts``: the host index of every rank (the cluster's node ranks, or a
    pretend split of one host).  Sizes are bytes of float32, rounded to a
    whole number of elements divisible by the world size.  Each timed call
    is preceded by a barrier on the default group.  Also checks once per
    size that both algorithms give the same (exact, integer-valued) sum.
    """
    es = get_state(ns)
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ViewError(f"iters must be >= 1 and warmup >= 0, got iters={iters!r}, warmup={warmup!r}")
    if not dist.is_initialized():
        raise ViewError("torch.distributed is not initialized on this engine: start the cluster with dpnb.start()")
    intra, inter = _subgroups(es, list(hosts))
    g = dist.get_world_size(intra)
    dev = es.comm_device
    n = es.world_size
    out_sizes: list[int] = []
    times: dict[str, list[list[float]]] = {p: [] for p in PHASES}
    equal = True
    for size in sizes:
        numel = max(n, (int(size) // 4 // n) * n)
        full = torch.empty(numel, dtype=torch.float32, device=dev)
        shard = torch.empty(numel // g, dtype=torch.float32, device=dev)
        # correctness (and warm-up): integer-valued inputs sum exactly in float32
        full.fill_(es.rank + 1)
        dist.all_reduce(full)
        flat_sum = full.clone()
        full.fill_(es.rank + 1)
        dist.barrier()
        _two_level(full, shard, intra, inter, dev)
        equal = equal and bool(torch.equal(full, flat_sum))
        for _ in range(warmup):
            dist.all_reduce(full)
            _two_level(full, shard, intra, inter, dev)
        per: dict[str, list[float]] = {p: [] for p in PHASES}
        for _ in range(iters):
            full.fill_(1.0)
            per["flat"].append(_timed(dist.all_reduce, full, None, dev))
            per["intra"].append(_timed(dist.all_reduce, full, intra, dev))
            shard.fill_(1.0)
            per["inter"].append(_timed(dist.all_reduce, shard, inter, dev))
            full.fill_(1.0)
            dist.barrier()
            device.synchronize(dev)
            phases = _two_level(full, shard, intra, inter, dev)
            for p, t in zip(("reduce_scatter", "all_reduce", "all_gather"), phases):
                per[p].append(t)
            per["two_level"].append(sum(phases))
        for p in PHASES:
            times[p].append(per[p])
        out_sizes.append(numel * 4)
    return {"rank": es.rank, "world_size": n, "per_host": g, "hosts": n // g,
            "backend": es.backend, "device": str(dev), "sizes": out_sizes,
            "times": times, "equal": equal}
