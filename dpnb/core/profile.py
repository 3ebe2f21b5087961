"""One profiled window of every rank: compute, communication, overlap, idle, stragglers.

The distributed story.  ``torch.profiler`` on each rank records what that
rank's threads and devices did; nothing in one rank's trace says which rank
held a collective up.  Put side by side on one clock, the traces answer the
questions of a scaling engineer:

* **Where does a rank's time go?**  Compute (CPU ops, or the GPU's
  non-NCCL kernels), communication (gloo's worker-thread spans on CPU, NCCL
  kernels on a GPU), the part of communication that compute hid
  (*overlapped*) and the part the rank sat through (*exposed*), and idle
  time (neither).
* **Who arrived last?**  A collective completes only when every rank has
  entered it.  The k-th collective of one kind on every rank is the same
  collective (collectives are issued in the same order on every rank, or
  the job would hang), so the rank whose k-th entry is latest held the
  others back, by the difference to the earliest entry.
* **Is the link doing what it should?**  A collective's *transfer* time is
  its end minus the last rank's entry (the wait for late peers is not the
  link's fault); bytes over that time give the bus bandwidth nccl-tests
  defines, beside :func:`dpnb.core.comm.collective_time`'s α–β model.

Names (gloo's, NCCL's old and new, c10d's) are read by :mod:`dpnb.core.traces`.

Clocks: each rank's trace has its own clock.  Every rank notes its wall
clock beside a marker event when profiling starts, which maps its trace onto
the wall clock; ranks on one host share that clock exactly.  Across hosts
the wall clocks differ by their NTP error, so each rank's offset is then
refined by the median difference of its collective end times to rank 0's
(a collective ends on all ranks within about one message latency), and the
residual spread is reported as the skew.

Pure Python (no torch): the engine extracts a bounded
:class:`~dpnb.core.traces.RankTrace` from its Chrome trace
(:mod:`dpnb.core.traces`); the notebook aligns and analyses the ranks'
traces with :func:`analyze`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .comm import Link, busbw, collective_bytes, collective_steps, collective_time, fit_link_ols
from .errors import ConfigError
from .traces import (  # noqa: F401  (re-exported: one import for the notebook side)
    CHECK_MARKER,
    CLOCK_MARKER,
    END_MARKER,
    MAX_COMM_EVENTS,
    MAX_COMPUTE_INTERVALS,
    CommEvent,
    Kind,
    RankTrace,
    classify,
    extract,
    merge,
    op_of,
    subtract,
    total,
    wall_offset,
)

#: the collectives the α–β model knows (see :mod:`dpnb.core.comm`)
MODELLED = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


# ------------------------------------------------------------------ analysis
@dataclass(frozen=True)
class RankStats:
    """One rank's window, in seconds."""

    rank: int
    window_s: float
    compute_s: float
    comm_s: float
    overlapped_s: float
    exposed_s: float
    idle_s: float
    steps: int

    @property
    def overlap_pct(self) -> float:
        """Share of communication hidden behind compute (0 when there was none)."""
        return 100.0 * self.overlapped_s / self.comm_s if self.comm_s > 0 else 0.0


@dataclass(frozen=True)
class Collective:
    """The k-th collective of one op, on every rank (seconds on the common clock)."""

    op: str
    index: int
    nbytes: int | None
    arrive_s: tuple[float, ...]
    end_s: tuple[float, ...]

    @property
    def last_rank(self) -> int:
        """Position (in the report's ranks) of the last to enter."""
        return max(range(len(self.arrive_s)), key=lambda r: self.arrive_s[r])

    @property
    def lateness_s(self) -> float:
        """Last entry minus first entry: how long the early ranks waited."""
        return max(self.arrive_s) - min(self.arrive_s)

    @property
    def transfer_s(self) -> float:
        """From the last rank's entry to the median end: what the link took."""
        return max(0.0, statistics.median(self.end_s) - max(self.arrive_s))


@dataclass(frozen=True)
class OpRow:
    """All collectives of one op and size: measured beside the α–β model."""

    op: str
    nbytes: int | None
    count: int
    transfer_s: float  # median
    busbw_Bps: float | None
    model_s: float | None


@dataclass(frozen=True)
class Straggler:
    """The rank whose entries into collectives came after the first rank's by the
    most in all: the one every other rank waited for.

    Its lateness in one collective is its entry minus the earliest entry.
    ``typical_late_s`` is the median over every matched collective (not only
    those it entered last), so a few tiny collectives it happened to enter
    last -- DDP's bucket-order broadcast, a loss all-reduce -- do not hide
    an 80 ms sleep before every backward.
    """

    rank: int
    last_at: int  # how many collectives it entered last
    of: int
    typical_late_s: float  # median lateness over all matched collectives
    total_late_s: float
    max_late_s: float


@dataclass(frozen=True)
class ProfileReport:
    """Every rank's profiled window on one clock, and what it says."""

    world_size: int
    ranks: tuple[RankTrace, ...]  # the ranks profiled, in rank order
    offsets_s: tuple[float, ...]  # add to a rank's trace-clock seconds for the common clock
    stats: tuple[RankStats, ...]
    collectives: tuple[Collective, ...]
    ops: tuple[OpRow, ...]
    straggler: Straggler | None
    link: Link | None
    skew_s: float | None  # residual clock disagreement (None: one host, one clock)
    clock_note: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    def busiest(self) -> RankStats | None:
        """The rank with the most compute (waiting in a collective is not work)."""
        return max(self.stats, key=lambda s: s.compute_s, default=None)


@dataclass(frozen=True)
class Profiled:
    """One profiled cell (or train): the analysis, where its traces are, how it ended."""

    report: ProfileReport
    folder: str  # rank<R>.json and merged.json
    what: str  # "cell", "train"
    failure: str = ""  # its one-line error ("" when it succeeded)
    at: float = field(default_factory=time.time)  # when it was analysed (seconds since the epoch)
    #: the trace files this profile has in ``folder`` once written (merged.json,
    #: rank<R>.json for each rank whose trace came home); empty: look in the folder
    files: tuple[str, ...] = ()
    #: the writing of those files, after the result returned (anything with
    #: ``wait(timeout) -> bool`` and ``error``); None: written before it returned
    writing: Any = field(default=None, compare=False, repr=False)

    @property
    def merged_path(self) -> str:
        """The merged Chrome trace (opens in ui.perfetto.dev)."""
        return self.folder.rstrip("/") + "/merged.json"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the trace files are written (the analysis is ready before
        them); True once they are, False if ``timeout`` passed first."""
        return self.writing is None or self.writing.wait(timeout)


def _matched(ranks: Sequence[RankTrace]):
    """``(op, k, positions)`` for the k-th collective of each op on every rank, with
    ``positions[i]`` its index in ``ranks[i].comm``; and a note per op whose counts
    differ (only the first ones of such an op are matched)."""
    groups, notes = [], []
    for op in sorted({c.op for r in ranks for c in r.comm}):
        idx = [[j for j, c in enumerate(r.comm) if c.op == op] for r in ranks]
        counts = [len(x) for x in idx]
        if len(set(counts)) > 1:
            notes.append(f"{op}: the ranks ran {', '.join(map(str, counts))} of them; "
                         f"the first {min(counts)} are matched")
        groups += [(op, k, [x[k] for x in idx]) for k in range(min(counts))]
    return groups, notes


def _match(ranks: Sequence[RankTrace], offs: Sequence[float]) -> tuple[list[Collective], list[str]]:
    groups, notes = _matched(ranks)
    out = []
    for op, k, pos in groups:
        cs = [r.comm[j] for r, j in zip(ranks, pos)]
        sizes = {c.nbytes for c in cs if c.nbytes is not None}
        out.append(Collective(op, k, max(sizes) if sizes else None,
                              tuple(c.arrive_us * 1e-6 + o for c, o in zip(cs, offs)),
                              tuple(c.end_us * 1e-6 + o for c, o in zip(cs, offs))))
    out.sort(key=lambda c: min(c.arrive_s))
    return out, notes


def _clip(ranks: Sequence[RankTrace], offs: Sequence[float]) -> tuple[list[RankTrace], int]:
    """Cut each rank's span of a collective at its first finisher's end plus one ring step.

    A collective completes on every rank within about one ring step (the
    last chunk's hop).  A span that runs on much longer was closed late:
    measured here, on two busy cores, gloo's worker thread closed its span
    2.6 ms after the calling thread had already run the optimizer step;
    left alone, that tail counts as communication hidden behind the next
    forward.
    """
    n = len(ranks)
    comm = [list(r.comm) for r in ranks]
    cut = 0
    for op, _, pos in _matched(ranks)[0]:
        steps = collective_steps(op, n) if op in MODELLED and n > 1 else 1  # type: ignore[arg-type]
        evs = [r.comm[j] for r, j in zip(ranks, pos)]
        ends = [c.end_us * 1e-6 + o for c, o in zip(evs, offs)]
        first, entered = min(ends), max(c.arrive_us * 1e-6 + o for c, o in zip(evs, offs))
        limit = first + max(0.0, first - entered) / steps
        for i, (c, end) in enumerate(zip(evs, ends)):
            if end > limit:
                comm[i][pos[i]] = replace(c, end_us=max(c.start_us, (limit - offs[i]) * 1e6))
                cut += 1
    return [replace(r, comm=tuple(c)) for r, c in zip(ranks, comm)], cut


def _causal_bounds(cols: Sequence[Collective], i: int) -> tuple[float, float]:
    """The shifts of rank ``i``'s clock (s) against the first rank's that keep every
    collective causal: no rank leaves a collective before the other has entered it.

    Only entries bound the shift: a busy CPU closes a span late, never early,
    so a late close only widens the bounds and cannot pull a clock.
    """
    lo = max(c.arrive_s[0] - c.end_s[i] for c in cols)
    hi = min(c.end_s[0] - c.arrive_s[i] for c in cols)
    return lo, hi


#: how far two hosts' wall clocks may disagree and still be taken as right
#: (NTP on a LAN), besides each rank's own uncertainty in reading its clock
NTP_SLACK_S = 0.001


def _align(ranks: Sequence[RankTrace]) -> tuple[list[float], float | None, str]:
    """Offsets (s) from each trace clock to the common clock; the skew; how.

    Several hosts: the wall clocks (NTP) come first, and the collectives check
    them (:func:`_causal_bounds`).  A rank none of them contradicts keeps its
    wall clock; one they contradict by no more than the clocks' own precision
    (the wall read beside the marker, :data:`NTP_SLACK_S`) is moved the least
    that makes every collective causal; one they contradict by more has a wall
    clock that is off, and is shifted so that its collectives end with the first
    rank's (median).  The ends come last because they are noisy one way:
    measured on two busy cores, the late rank -- compute waiting right after its
    collective -- closed its spans ~40 ms after the rank that had waited, and
    aligning on the ends took 40 ms off a 100 ms lateness.
    """
    offs = [r.wall_offset_us * 1e-6 for r in ranks]
    t0 = min(r.start_us * 1e-6 + o for r, o in zip(ranks, offs))
    offs = [o - t0 for o in offs]
    if len({r.host for r in ranks}) <= 1:
        return offs, None, "one host: the ranks' wall clocks are the same clock"
    cols, _ = _match(ranks, offs)
    if not cols:
        return offs, None, ("several hosts, aligned on their wall clocks (NTP); no collective "
                            "to check the skew against")
    nudged, moved = [], []
    for i in range(1, len(ranks)):
        lo, hi = _causal_bounds(cols, i)
        if lo <= 0.0 <= hi:
            continue
        least = lo if lo > 0.0 else hi
        slack = NTP_SLACK_S + (ranks[0].wall_err_us + ranks[i].wall_err_us) * 1e-6
        if lo <= hi and abs(least) <= slack:
            offs[i] += least
            nudged.append(ranks[i].rank)
        else:
            offs[i] += statistics.median(c.end_s[0] - c.end_s[i] for c in cols)
            moved.append(ranks[i].rank)
    cols, _ = _match(ranks, offs)
    skew = statistics.median(max(c.end_s) - min(c.end_s) for c in cols)
    how = "every collective agrees with the wall clocks (NTP), kept" if not (nudged or moved) \
        else "; ".join(
            ([f"ranks {nudged} moved the least that makes every collective causal (their wall "
              f"clocks were off by less than their precision)"] if nudged else []) +
            ([f"ranks {moved} shifted so that their collectives end with rank "
              f"{ranks[0].rank}'s (median), their wall clocks had one leave a collective "
              f"before another entered it"] if moved else []))
    return offs, skew, f"several hosts: {how}; residual skew {skew * 1e6:.0f} µs"


@dataclass(frozen=True)
class Lanes:
    """One rank's lanes: merged (start, end) intervals in seconds on the common clock."""

    compute: tuple[tuple[float, float], ...]
    comm: tuple[tuple[float, float], ...]
    exposed: tuple[tuple[float, float], ...]  # communication no compute hid


def _lanes_us(r: RankTrace) -> tuple[list, list, list]:
    comp = list(r.compute)
    comm = merge((c.start_us, c.end_us) for c in r.comm)
    return comp, comm, subtract(comm, comp)


def lanes(report: ProfileReport, i: int) -> Lanes:
    """``report.ranks[i]``'s compute, communication and exposed intervals, on the common clock."""
    off = report.offsets_s[i]
    return Lanes(*(tuple((s * 1e-6 + off, e * 1e-6 + off) for s, e in ivs)
                   for ivs in _lanes_us(report.ranks[i])))


def _stats(r: RankTrace) -> RankStats:
    comp, comm, exposed = _lanes_us(r)
    both = merge(comp + comm)
    window = max(r.end_us - r.start_us, total(both))
    cs, ex = total(comm), total(exposed)
    return RankStats(r.rank, window * 1e-6, total(comp) * 1e-6, cs * 1e-6, (cs - ex) * 1e-6,
                     ex * 1e-6, max(0.0, window - total(both)) * 1e-6, r.steps)


def fit_link(cols: Sequence[Collective], n: int) -> Link | None:
    """α–β through the measured transfers (see :func:`dpnb.core.comm.fit_link_ols`)."""
    used = [c for c in cols if c.op in MODELLED and c.nbytes and c.transfer_s > 0]
    if n < 2 or not used:
        return None
    return fit_link_ols([collective_bytes(c.op, c.nbytes, n) for c in used],  # type: ignore[arg-type]
                        [c.transfer_s for c in used],
                        statistics.median(collective_steps(c.op, n) for c in used),  # type: ignore[arg-type]
                        "collectives", "transfer time over all collectives")


def _op_rows(cols: Sequence[Collective], n: int, link: Link | None) -> list[OpRow]:
    groups: dict[tuple[str, int | None], list[Collective]] = {}
    for c in cols:
        groups.setdefault((c.op, c.nbytes), []).append(c)
    rows = []
    for (op, nb), cs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        t = statistics.median(c.transfer_s for c in cs)
        bw = busbw(op, nb, t, n) if op in MODELLED and nb and t > 0 and n > 1 else None  # type: ignore[arg-type]
        model = (collective_time(op, nb, n, link)  # type: ignore[arg-type]
                 if link and op in MODELLED and nb and n > 1 else None)
        rows.append(OpRow(op, nb, len(cs), t, bw, model))
    return rows


def _straggler(cols: Sequence[Collective], ranks: Sequence[RankTrace]) -> Straggler | None:
    late = [c for c in cols if c.op != "barrier" and len(c.arrive_s) > 1]
    if not late:
        return None
    n = len(ranks)
    behind = [[c.arrive_s[i] - min(c.arrive_s) for c in late] for i in range(n)]
    i = max(range(n), key=lambda j: sum(behind[j]))
    return Straggler(ranks[i].rank, sum(1 for c in late if c.last_rank == i), len(late),
                     statistics.median(behind[i]), sum(behind[i]), max(behind[i]))


def analyze(ranks: Sequence[RankTrace], world_size: int, link: Link | None = None,
            notes: Sequence[str] = ()) -> ProfileReport:
    """Align the ranks' traces, split each window, match collectives, find the straggler.

    ``link``: the α–β model's link (default: fitted to the measured
    transfers).  Raises :class:`ConfigError` when there is nothing to analyse.
    """
    ranks = sorted(ranks, key=lambda r: r.rank)
    if not ranks:
        raise ConfigError("no rank sent a profile: nothing to show")
    offs, skew, how = _align(ranks)
    ranks, cut = _clip(ranks, offs)
    cols, match_notes = _match(ranks, offs)
    n = len(ranks)
    if link is None:
        link = fit_link(cols, n)
    notes = list(notes) + match_notes
    dropped = [r.rank for r in ranks if r.dropped]
    if dropped:
        notes.append(f"ranks {dropped}: more than {MAX_COMPUTE_INTERVALS} compute intervals or "
                     f"{MAX_COMM_EVENTS} collectives; the rest were left out (profile fewer steps)")
    notes += [f"rank {r.rank}: {r.error}" for r in ranks if r.error]
    if cut:
        notes.append(f"{cut} communication spans outlasted their collective's first finisher by "
                     f"more than one ring step and were cut there (a busy CPU closes gloo's spans late)")
    return ProfileReport(world_size, tuple(ranks), tuple(offs), tuple(_stats(r) for r in ranks),
                         tuple(cols), tuple(_op_rows(cols, n, link)), _straggler(cols, ranks), link,
                         skew, how, tuple(notes))


def merged_trace(report: ProfileReport, traces: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace of every rank (``pid`` = rank), shifted onto the common clock.

    ``traces``: each rank's own Chrome trace (as torch.profiler wrote it).
    Opens in Perfetto (ui.perfetto.dev) and chrome://tracing.
    """
    out: list[dict[str, Any]] = []
    for i, r in enumerate(report.ranks):
        t = traces.get(r.rank)
        if t is None:
            continue
        shift = report.offsets_s[i] * 1e6
        out.append({"name": "process_name", "ph": "M", "pid": r.rank,
                    "args": {"name": f"rank {r.rank} ({r.host})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r.rank, "args": {"sort_index": r.rank}})
        for e in t.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue
            e = dict(e)
            e["pid"] = r.rank
            if "ts" in e:
                e["ts"] = float(e["ts"]) + shift
            out.append(e)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"dpnb": f"{len(report.ranks)} ranks on one clock: {report.clock_note}"}}
