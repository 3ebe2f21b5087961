"""Communication cost of the collectives data parallelism uses.

The distributed story
---------------------
After backward, DDP must turn N different local gradients into one average
on every rank: an **all-reduce**.  The bandwidth-optimal way for large
messages is the ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 69(2); Thakur, Rabenseifner &
Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1)): split the S-byte buffer into N chunks; in N−1
**reduce-scatter** steps each rank sends one chunk to its neighbour and adds
the chunk it receives, so each rank ends with one fully reduced chunk; in
N−1 **all-gather** steps the reduced chunks travel once more around the ring.
Each rank therefore sends (and receives)::

    all-reduce      2(N−1)/N · S     in 2(N−1) steps
    reduce-scatter   (N−1)/N · S     in  N−1  steps   (S = full input)
    all-gather       (N−1)/N · S     in  N−1  steps   (S = full output)
    broadcast            S           pipelined chain, N−1 hops of latency

which is independent of N for large N: the reason ring all-reduce scales.
ZeRO-1/2 replace the all-reduce with a reduce-scatter of gradients plus an
all-gather of updated parameters (same 2Ψ volume); ZeRO-3 all-gathers the
parameters twice (forward and backward) and reduce-scatters gradients once:
3Ψ (Rajbhandari et al. 2020, arXiv:1910.02054, §7).

Time uses the α–β (latency–bandwidth, "Hockney") model of Thakur et al.:
``steps × α + bytes_per_rank / β``, with β the per-rank link bandwidth in one
direction.  nccl-tests report the measured time as two bandwidths
(``doc/PERFORMANCE.md`` in github.com/NVIDIA/nccl-tests): algbw = S/t and
busbw = algbw × factor, the factor being 2(N−1)/N for all-reduce, (N−1)/N for
reduce-scatter and all-gather, 1 for broadcast and reduce, so that busbw is
comparable to the link's peak whatever N is.  In this model busbw equals β
for large messages.

Units: bytes, seconds, bytes/second.  Link presets use decimal units
(1 GB/s = 1e9 B/s; 400 Gb/s = 50 GB/s) and are *nominal* peak figures; real
achievable bandwidth is lower (protocol overhead, congestion, topology), so
measure your own with nccl-tests or dpnb's benchmark and build a
:class:`Link` from it.  Not modelled: contention with other traffic, tree or
NVLS algorithms, in-network reduction (SHARP), compute cost of the reduction.
"""

from dataclasses import dataclass
from typing import Literal, Sequence

from dpnb.core.errors import ConfigError

Collective = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


@dataclass(frozen=True)
class Link:
    """A per-rank link: one-direction bandwidth (bytes/s) and per-step latency (s)."""

    name: str
    bandwidth_Bps: float
    latency_s: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0:
            raise ConfigError(f"link {self.name!r}: bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        if not self.latency_s >= 0:
            raise ConfigError(f"link {self.name!r}: latency_s must be ≥ 0, got {self.latency_s!r}")


#: Nominal per-GPU link presets (decimal units, one direction).  Latencies are
#: order-of-magnitude per-step costs, not measurements.
LINKS: dict[str, Link] = {
    "nvlink4-h100": Link(
        "nvlink4-h100", 450e9, 2e-6,
        "H100 SXM NVLink 4: 18 links × 25 GB/s = 450 GB/s each way (900 GB/s bidirectional, NVIDIA H100 datasheet)",
    ),
    "ib-ndr-400": Link(
        "ib-ndr-400", 50e9, 5e-6, "InfiniBand NDR 400 Gb/s per NIC = 50 GB/s (one NIC per GPU)",
    ),
    "ib-hdr-200": Link(
        "ib-hdr-200", 25e9, 5e-6, "InfiniBand HDR 200 Gb/s per NIC = 25 GB/s (one NIC per GPU)",
    ),
    "pcie-gen4-x16": Link(
        "pcie-gen4-x16", 25e9, 5e-6,
        "PCIe 4.0 x16: 16 GT/s × 16 lanes ≈ 31.5 GB/s raw each way, ~25 GB/s achievable",
    ),
    "ethernet-100g": Link(
        "ethernet-100g", 12.5e9, 10e-6, "100 Gb/s Ethernet = 12.5 GB/s (RoCE/TCP)",
    ),
    "gloo-loopback": Link(
        "gloo-loopback", 2e9, 50e-6,
        "gloo over TCP loopback between CPU processes on one host: a modest guess; measure it",
    ),
}


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"number of ranks n must be a positive integer, got {n!r}")


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ConfigError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVES)}")


def _check_size(size_bytes: float) -> None:
    if not size_bytes >= 0:
        raise ConfigError(f"size_bytes must be ≥ 0, got {size_bytes!r}")


def bus_factor(kind: Collective, n: int) -> float:
    """nccl-tests busbw/algbw factor: 2(n−1)/n all-reduce, (n−1)/n RS/AG, 1 broadcast/reduce."""
    _check_kind(kind)
    _check_n(n)
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def collective_bytes(kind: Collective, size_bytes: float, n: int) -> float:
    """Bytes each rank sends (= receives) in a ring/chain collective on ``size_bytes``.

    ``size_bytes`` is the full buffer: the all-reduce buffer, the reduce-scatter
    *input*, the all-gather *output*, the broadcast message.  Ring all-reduce
    2(N−1)/N·S, reduce-scatter and all-gather (N−1)/N·S (Patarasuk & Yuan
    2009; Thakur et al. 2005); pipelined broadcast/reduce S.  0 when N = 1
    (nothing to exchange).
    """
    _check_size(size_bytes)
    if n == 1:
        _check_kind(kind)
        return 0.0
    return bus_factor(kind, n) * size_bytes


def collective_steps(kind: Collective, n: int) -> int:
    """Latency-bearing steps: 2(N−1) for ring all-reduce, N−1 for the others."""
    _check_kind(kind)
    _check_n(n)
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def collective_time(kind: Collective, size_bytes: float, n: int, link: Link) -> float:
    """α–β time of one collective: steps × α + collective_bytes / β (seconds).

    E.g. 1B fp16 gradients (2 GB) all-reduced over 8 ranks move 3.5 GB per
    rank: ≥ 140 ms at 25 GB/s, ≈ 70 ms at 50 GB/s.  Lower bound: assumes
    the full link bandwidth and no contention.
    """
    return collective_steps(kind, n) * link.latency_s + collective_bytes(kind, size_bytes, n) / link.bandwidth_Bps


def fit_link_ols(sent_bytes: Sequence[float], times_s: Sequence[float], steps: float, what: str,
                 fallback: str) -> Link | None:
    """α–β through measured collectives: ``sent_bytes`` per rank (see
    :func:`collective_bytes`), their times, and the collective's latency steps.

    With three or more distinct sizes, ordinary least squares (its residuals
    sum to zero, so the link reproduces the total measured time) when it
    gives α ≥ 0 and β > 0; otherwise α = 0 and β = bytes / time over all.
    ``what`` / ``fallback`` name the measurements in the link's note.  None
    when there is nothing to fit.
    """
    xs, ts = list(sent_bytes), list(times_s)
    if not xs:
        return None
    if len(set(xs)) >= 3:
        k = len(xs)
        mx, mt = sum(xs) / k, sum(ts) / k
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
        a = mt - slope * mx
        if slope > 0 and a >= 0:
            return Link("fitted", 1.0 / slope, a / steps, f"least squares over {k} {what}")
    return Link("fitted", sum(xs) / sum(ts), 0.0, f"β = bytes / {fallback} (α = 0)")


def algbw(size_bytes: float, time_s: float) -> float:
    """nccl-tests algorithm bandwidth S / t (bytes/s)."""
    _check_size(size_bytes)
    if not time_s > 0:
        raise ConfigError(f"time_s must be > 0, got {time_s!r}")
    return size_bytes / time_s


def busbw(kind: Collective, size_bytes: float, time_s: float, n: int) -> float:
    """nccl-tests bus bandwidth algbw × factor (see :func:`bus_factor`).

    For all-reduce with N ≥ 2 busbw ≥ algbw; for broadcast/reduce they are
    equal; for reduce-scatter/all-gather (whose S is the full N-rank buffer)
    busbw ≤ algbw, as nccl-tests defines them.
    """
    return algbw(size_bytes, time_s) * bus_factor(kind, n)


@dataclass(frozen=True)
class CommPhase:
    """One collective in a training step: what it moves and how many bytes per rank."""

    collective: Collective
    what: str
    size_bytes: float
    bytes_per_rank: float


@dataclass(frozen=True)
class StepVolume:
    """Per-rank communication of one optimizer step for a ZeRO stage.

    ``total`` is what each rank sends with ring collectives (the (N−1)/N
    factors included); ``asymptotic`` is the large-N limit the ZeRO paper
    quotes (2Ψ or 3Ψ elements × bytes_per_grad).
    """

    stage: int
    dp: int
    phases: tuple[CommPhase, ...]
    total: float
    asymptotic: float

    def time(self, link: Link) -> float:
        """α–β time of all phases on ``link``, run back to back (no overlap)."""
        return sum(collective_time(p.collective, p.size_bytes, self.dp, link) for p in self.phases)


def step_volume(n_params: float, bytes_per_grad: int, dp: int, stage: int) -> StepVolume:
    """Gradient/parameter traffic per rank per step under ZeRO ``stage``.

    Rajbhandari et al. 2020 (arXiv:1910.02054) §7: DDP all-reduces the
    gradients (2Ψ); ZeRO-1 and ZeRO-2 reduce-scatter the gradients (Ψ) and
    all-gather the updated parameters (Ψ): still 2Ψ; ZeRO-3 all-gathers
    parameters for forward (Ψ) and again for backward (Ψ) and reduce-scatters
    gradients (Ψ): 3Ψ, i.e. 1.5× DDP.  Ψ here is in elements; one element is
    ``bytes_per_grad`` bytes (2 for fp16/bf16 gradients; the parameter
    all-gathers are assumed to use the same element size, as with fp16
    working weights).  With N ranks each
    term carries the ring factor (N−1)/N.  Example: 7B fp16 gradients under DDP
    are 14 GB; per step each rank moves 2(N−1)/N × 14 GB, → 28 GB for large N.
    Not counted: gradient-accumulation micro-steps (no traffic under
    ``no_sync``), loss/metric all-reduces, parameter broadcast at start-up.
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_n(dp)
    if not n_params >= 0:
        raise ConfigError(f"n_params must be ≥ 0, got {n_params!r}")
    size = float(n_params) * bytes_per_grad
    spec: list[tuple[Collective, str]]
    if stage == 0:
        spec = [("all_reduce", "gradients")]
    elif stage in (1, 2):
        spec = [("reduce_scatter", "gradients"), ("all_gather", "updated parameters")]
    else:
        spec = [
            ("all_gather", "parameters for forward"),
            ("all_gather", "parameters for backward"),
            ("reduce_scatter", "gradients"),
        ]
    phases = tuple(
        CommPhase(kind, what, size, collective_bytes(kind, size, dp))
        for kind, what in spec
    )
    asym = (3.0 if stage == 3 else 2.0) * size
    return StepVolume(stage, dp, phases, sum(p.bytes_per_rank for p in phases), asym)
