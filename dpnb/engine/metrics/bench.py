"""Real collectives for the views: the all-reduce benchmark and the ring demonstration.

Both are collectives over the default group: every rank must call them at
once (the default ``ranks=None`` of ``cluster.call``).  A barrier precedes
each timed call so every rank starts together; the notebook takes, per
iteration, the slowest rank.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from dpnb.engine import device
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import ViewError

BENCH_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def _collective(kind: str, full: torch.Tensor, shard: torch.Tensor) -> None:
    """One timed collective: all-reduce ``full``, reduce-scatter it into
    ``shard``, or all-gather ``shard`` into it."""
    if kind == "all_reduce":
        dist.all_reduce(full)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_single(shard, full)
    else:
        dist.all_gather_single(full, shard)


def _sync(dev: torch.device) -> None:
    device.synchronize(dev)


def bench_collective(
    ns: dict,
    sizes: list,
    kind: str = "all_reduce",
    iters: int = 5,
    warmup: int = 1,
    dtype: str = "float32",
) -> dict:
    """Time ``kind`` on the default group for each message size (collective).

    Every rank must call this with the same arguments.  For each size S
    (bytes; rounded down to a whole number of elements divisible by the world
    size, at least one element per rank) it runs ``warmup`` untimed calls,
    then ``iters`` timed ones, each preceded by a barrier so the ranks start
    together.  S is the nccl-tests "size": the all-reduce buffer, the
    reduce-scatter *input*, the all-gather *output*.  Returns this rank's
    times; the notebook takes, per iteration, the slowest rank (a collective
    is done when the last rank is) and the median over iterations.
    """
    es = get_state(ns)
    if kind not in BENCH_KINDS:
        raise ViewError(f"unknown collective {kind!r}: choose one of {', '.join(BENCH_KINDS)}")
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ViewError(f"iters must be >= 1 and warmup >= 0, got iters={iters!r}, warmup={warmup!r}")
    if not dist.is_initialized():
        raise ViewError("torch.distributed is not initialized on this engine: start the cluster with dpnb.start()")
    dev = es.comm_device
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    n = es.world_size
    out_sizes: list[int] = []
    times: list[list[float]] = []
    for size in sizes:
        numel = max(n, (int(size) // item // n) * n)
        full = torch.ones(numel, dtype=dt, device=dev)
        shard = torch.ones(numel // n, dtype=dt, device=dev)
        op = functools.partial(_collective, kind, full, shard)
        for _ in range(warmup):
            op()
        _sync(dev)
        ts = []
        for _ in range(iters):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            op()
            _sync(dev)
            ts.append(time.perf_counter() - t0)
        out_sizes.append(numel * item)
        times.append(ts)
        del full, shard, op  # freed before the next size is allocated
    return {
        "rank": es.rank,
        "world_size": n,
        "backend": es.backend,
        "device": str(dev),
        "kind": kind,
        "dtype": dtype,
        "sizes": out_sizes,
        "times": times,
        "median_s": [statistics.median(t) for t in times],
    }


def bench_allreduce(ns: dict, sizes: list, iters: int = 5, warmup: int = 1) -> dict:
    """:func:`bench_collective` for ``all_reduce`` (collective: every rank)."""
    return bench_collective(ns, sizes, "all_reduce", iters, warmup)


# --------------------------------------------------------------------------
# ring all-reduce = reduce-scatter + all-gather, on real tensors


def ring_demo(ns: dict, numel: int | None = None, seed: int = 0) -> dict:
    """Reduce-scatter then all-gather real tensors and compare with all-reduce (collective).

    Each rank builds its own input x_r (integer-valued float32, seeded by
    ``seed`` and the rank, so sums are exact and the comparison can demand
    bit equality).  ``reduce_scatter_single`` leaves rank r with chunk r of
    Σ x (1/N of the buffer, (N−1)/N·S bytes sent per rank);
    ``all_gather_single`` sends every reduced chunk to every rank
    (another (N−1)/N·S); the result must equal ``all_reduce`` of the same
    inputs, which moves 2(N−1)/N·S per rank with a ring.
    """
    es = get_state(ns)
    n = es.world_size
    dev = es.comm_device
    if numel is None:
        numel = 2 * n
    numel = max(n, (int(numel) // n) * n)
    g = torch.Generator().manual_seed(int(seed) * 1000 + es.rank)
    x = torch.randint(-9, 10, (numel,), generator=g).to(torch.float32).to(dev)
    shard = torch.empty(numel // n, dtype=torch.float32, device=dev)
    gathered = torch.empty(numel, dtype=torch.float32, device=dev)
    ar = x.clone()
    dist.barrier()
    _sync(dev)
    t0 = time.perf_counter()
    dist.reduce_scatter_single(shard, x.clone())
    _sync(dev)
    t1 = time.perf_counter()
    dist.all_gather_single(gathered, shard)
    _sync(dev)
    t2 = time.perf_counter()
    dist.barrier()
    _sync(dev)
    t3 = time.perf_counter()
    dist.all_reduce(ar)
    _sync(dev)
    t4 = time.perf_counter()
    small = numel <= 64

    def lst(t: torch.Tensor) -> list:
        return [float(v) for v in t.cpu().tolist()] if small else [float(v) for v in t[:8].cpu().tolist()]

    return {
        "rank": es.rank,
        "world_size": n,
        "numel": numel,
        "bytes": numel * 4,
        "chunk_numel": numel // n,
        "shown_all": small,
        "input": lst(x),
        "shard": [float(v) for v in shard.cpu().tolist()] if small else lst(shard),
        "gathered": lst(gathered),
        "allreduce": lst(ar),
        "equal": bool(torch.equal(gathered, ar)),
        "max_abs_diff": float((gathered - ar).abs().max().item()),
        "reduce_scatter_s": t1 - t0,
        "all_gather_s": t2 - t1,
        "all_reduce_s": t4 - t3,
    }

