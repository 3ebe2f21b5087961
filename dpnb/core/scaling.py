"""Throughput scaling with DP degree, stragglers, and hierarchical all-reduce.

The distributed story
---------------------
With N data-parallel ranks each step does the same per-rank compute as one
rank would, plus a gradient all-reduce whose cost does not vanish as N grows
(ring all-reduce moves 2(N−1)/N · S per rank, see :mod:`dpnb.core.comm`).
What is not hidden behind backward (see :mod:`dpnb.core.bucketing`) adds to
the step, so throughput grows slower than N.  Scaling efficiency is
throughput(N) / (N × throughput(1)) — weak scaling, a fixed per-rank batch, as
in Li et al. 2020 (PyTorch DDP, arXiv:2006.15704, §5) and Goyal et al. 2017
(arXiv:1706.02677, §5).

Synchronous data parallelism is also only as fast as its slowest rank: the
all-reduce cannot finish before every rank has contributed, so a step takes
the *maximum* of the per-rank times.  If each rank independently straggles
with probability p in a step, the chance that at least one of N does is
1 − (1 − p)^N, which approaches 1 quickly as N grows (Dean & Barroso 2013,
"The Tail at Scale", CACM 56(2), make the same argument for fan-out
services).

Hierarchical all-reduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``; Jia et
al. 2018, "Highly Scalable Deep Learning Training System with
Mixed-Precision", arXiv:1807.11205) does a reduce-scatter inside each node
over the fast link, an all-reduce of each 1/g shard across nodes over the slow
link (the g GPUs of a node run their inter-node rings in parallel, one per
NIC), then an all-gather inside the node.  Inter-node bytes drop by g versus
a flat ring whose every step waits for the slow link.

All times are in seconds; models are α–β lower bounds, not predictions.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpnb.core.comm import Link, collective_time
from dpnb.core.errors import ConfigError


@dataclass(frozen=True)
class ScalingPoint:
    """One DP degree of a scaling curve.

    ``step_s`` = compute_s + exposed_comm_s; ``throughput`` in samples/s
    (dp × samples_per_rank / step_s); ``speedup`` vs one rank; ``efficiency`` =
    speedup / dp.
    """

    dp: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    throughput: float
    speedup: float
    efficiency: float


def allreduce_comm(grad_bytes: float, link: Link) -> Callable[[int], float]:
    """A comm-time model for :func:`scaling`: ring all-reduce of ``grad_bytes`` on ``link``."""

    def comm(n: int) -> float:
        return collective_time("all_reduce", grad_bytes, n, link)

    return comm


def scaling(
    dp_degrees: Sequence[int],
    compute_s: float,
    comm_s: float | Callable[[int], float],
    overlap: float = 0.0,
    samples_per_rank: int = 1,
) -> list[ScalingPoint]:
    """Step time, throughput and scaling efficiency for each DP degree.

    ``comm_s`` is the gradient synchronisation time, either a constant or a
    function of N (e.g. :func:`allreduce_comm`); one rank communicates
    nothing.  A fraction ``overlap`` of it runs under backward, but no more
    than ``compute_s`` can be hidden: exposed = comm − min(overlap × comm,
    compute).  The single-rank reference is compute only.
    """
    if not compute_s > 0:
        raise ConfigError(f"compute_s must be > 0, got {compute_s!r}")
    if not 0.0 <= overlap <= 1.0:
        raise ConfigError(f"overlap must be a fraction in [0, 1], got {overlap!r}")
    if samples_per_rank < 1:
        raise ConfigError(f"samples_per_rank must be ≥ 1, got {samples_per_rank!r}")
    base = samples_per_rank / compute_s
    points = []
    for n in dp_degrees:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"DP degrees must be positive ints, got {n!r}")
        c = 0.0 if n == 1 else float(comm_s(n) if callable(comm_s) else comm_s)
        if c < 0:
            raise ConfigError(f"comm time must be ≥ 0, got {c!r} at DP={n}")
        exposed = c - min(overlap * c, compute_s)
        step = compute_s + exposed
        thr = n * samples_per_rank / step
        points.append(ScalingPoint(n, step, compute_s, c, exposed, thr, thr / base, thr / base / n))
    return points


def step_time(rank_times_s: Sequence[float]) -> float:
    """A synchronous step's time: the maximum over ranks (all wait for the slowest)."""
    if not rank_times_s:
        raise ConfigError("need at least one rank time")
    return max(rank_times_s)


def straggler_probability(p: float, n: int) -> float:
    """P(at least one of ``n`` independent ranks straggles) = 1 − (1 − p)^n."""
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"p must be a probability in [0, 1], got {p!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be a positive int, got {n!r}")
    if p == 1.0:
        return 1.0
    # expm1/log1p keep precision when p is tiny and n large.
    return -math.expm1(n * math.log1p(-p))


@dataclass(frozen=True)
class StragglerEstimate:
    """Expected cost of stragglers for one synchronous step.

    ``expected_step_s`` = base_s + delay_s × P(any straggles);
    ``efficiency`` = base_s / expected_step_s.
    """

    n: int
    p: float
    base_s: float
    delay_s: float
    probability: float
    expected_step_s: float
    efficiency: float


def expected_step_time(base_s: float, n: int, p: float, delay_s: float) -> float:
    """Expected step time when each rank independently runs ``delay_s`` late with probability ``p``.

    The step is the max over ranks, so it is base_s + delay_s whenever at
    least one rank straggles: E = base_s + delay_s × (1 − (1 − p)^n).
    """
    if base_s < 0 or delay_s < 0:
        raise ConfigError(f"base_s and delay_s must be ≥ 0, got {base_s!r}, {delay_s!r}")
    return base_s + delay_s * straggler_probability(p, n)


def straggler_estimate(base_s: float, n: int, p: float, delay_s: float) -> StragglerEstimate:
    """:func:`expected_step_time` with the probability and efficiency spelled out."""
    prob = straggler_probability(p, n)
    e = expected_step_time(base_s, n, p, delay_s)
    return StragglerEstimate(n, p, base_s, delay_s, prob, e, base_s / e if e > 0 else 1.0)


def ring_allreduce_time(size_bytes: float, n: int, link: Link) -> float:
    """Flat ring all-reduce over ``n`` ranks on ``link``: 2(n−1)α + 2(n−1)/n · S/β."""
    return collective_time("all_reduce", size_bytes, n, link)


@dataclass(frozen=True)
class HierarchicalAllReduce:
    """Phases of a hierarchical all-reduce and the flat ring it replaces (seconds)."""

    nodes: int
    gpus_per_node: int
    intra_reduce_scatter_s: float
    inter_all_reduce_s: float
    intra_all_gather_s: float
    total_s: float
    flat_ring_s: float

    @property
    def speedup(self) -> float:
        """flat_ring_s / total_s."""
        return self.flat_ring_s / self.total_s if self.total_s > 0 else 1.0


def hierarchical_allreduce_time(
    size_bytes: float,
    nodes: int,
    gpus_per_node: int,
    intra_link: Link,
    inter_link: Link,
    *,
    shared_nic: bool = False,
) -> HierarchicalAllReduce:
    """Hierarchical (intra-node, then inter-node) all-reduce vs a flat ring.

    Phases: reduce-scatter of S over the g GPUs of a node (``intra_link``);
    all-reduce of the S/g shard across the ``nodes`` nodes (``inter_link``,
    the per-GPU share of the network; the g shards go in parallel);
    all-gather of S inside the node.  The flat ring over nodes × g ranks has
    every step gated by the slower link (largest α, smallest β), since some
    hop of the ring crosses nodes.  Horovod / Jia et al. 2018
    (arXiv:1807.11205); ring costs from Patarasuk & Yuan 2009.

    ``shared_nic``: the g ranks of a node share one network link (a CPU
    host, or GPUs behind one NIC), so ``inter_link`` is each rank's share
    while all g send at once.  A flat ring has only one stream leaving each
    node per direction, which then gets the whole link, g times that share
    (measured on two namespace hosts behind a 1 Gbit/s tbf: flat ring 0.85 s
    for 64 MiB on 2×2 ranks, where the per-rank share predicts 1.6 s).
    Without it (one NIC per GPU, as in DGX-class nodes) the ring's
    crossing hop has one GPU's NIC.
    """
    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    g = gpus_per_node
    rs = collective_time("reduce_scatter", size_bytes, g, intra_link)
    ar = collective_time("all_reduce", size_bytes / g, nodes, inter_link)
    ag = collective_time("all_gather", size_bytes, g, intra_link)
    if nodes == 1:
        slow = intra_link
    elif g == 1:
        slow = inter_link
    else:
        crossing_Bps = inter_link.bandwidth_Bps * (g if shared_nic else 1)
        slow = Link(
            "flat-ring-bottleneck",
            min(intra_link.bandwidth_Bps, crossing_Bps),
            max(intra_link.latency_s, inter_link.latency_s),
        )
    flat = ring_allreduce_time(size_bytes, nodes * g, slow)
    return HierarchicalAllReduce(nodes, g, rs, ar, ag, rs + ar + ag, flat)
