"""One rank's measured training step as lanes of time: what a gradient-sync view draws.

Each rank's engine records, for a step, when forward ran, when backward's
modules ran, when each DDP bucket's all-reduce (or each FSDP all-gather /
reduce-scatter) was launched and finished, and when ``optimizer.step()`` ran
(:func:`dpnb.engine.metrics.views.gradsync_records`; seconds from the step's
start on that rank's clock, no communication to take them).  This module
turns one such record into :class:`Segment` bars and the overlap numbers:
how much of the step's communication ran while backward still computed
(hidden) and how much the step waited for (exposed).  Pure (no torch): the
notebook's gradsync view and JupyterLab's panel both draw from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One bar on a timeline lane, seconds from the step start."""

    lane: str
    start: float
    end: float
    label: str = ""
    index: int | None = None
    queued: bool = False  # a bucket launched while the previous all-reduce still ran: waiting

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RankTimeline:
    """One rank's measured step.

    ``compute_end``: when backward finished computing (last gradient ready;
    FSDP: when the optimizer step began); ``comm_end``: when the last
    gradient collective finished; ``exposed_s`` = max(0, comm_end −
    compute_end) and ``hidden_s`` = comm_s − exposed_s, as in
    :class:`dpnb.core.Timeline`.
    """

    rank: int
    step: int
    strategy: str
    segments: tuple[Segment, ...]
    step_s: float
    backward_start: float | None
    compute_end: float | None
    comm_s: float
    comm_end: float | None
    exposed_s: float
    hidden_s: float
    optimizer_timed: bool

    @property
    def overlap_fraction(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0

    def lane(self, name: str, queued: bool = False) -> list[Segment]:
        """Segments of lane ``name`` (without the queued parts of all-reduces unless ``queued``)."""
        return [s for s in self.segments if s.lane == name and (queued or not s.queued)]


def _fnum(x) -> float | None:
    return None if x is None else float(x)


def rank_timeline(rec: dict) -> RankTimeline:
    """Segments and overlap numbers of one rank's step record (see ``dpnb.engine.metrics.views.gradsync_records``)."""
    segs: list[Segment] = []
    for k, f in enumerate(rec.get("forward") or []):
        if f.get("start") is not None and f.get("end") is not None:
            segs.append(Segment("forward", f["start"], f["end"], f"fwd {k}" if len(rec["forward"]) > 1 else "fwd"))
    bw = rec.get("backward") or {}
    intervals = [iv for iv in (bw.get("intervals") or []) if iv.get("start") is not None and iv.get("end") is not None]
    for iv in intervals:
        segs.append(Segment("backward", iv["start"], iv["end"], iv.get("module", "")))
    comm_iv: list[tuple[float, float]] = []
    buckets = sorted(rec.get("buckets") or [], key=lambda b: (b["start"] if b["start"] is not None else 0.0))
    prev_end = None
    for b in buckets:
        if b.get("start") is None:
            continue
        end = b["end"] if b.get("end") is not None else b["start"]
        begin = b["start"] if prev_end is None else min(max(b["start"], prev_end), end)
        if begin > b["start"]:
            segs.append(Segment("all_reduce", b["start"], begin, f"b{b['index']} queued", b["index"], True))
        segs.append(Segment("all_reduce", begin, end, f"b{b['index']}", b["index"]))
        comm_iv.append((b["start"], end))
        prev_end = end if prev_end is None else max(prev_end, end)
    fsdp = [c for c in (rec.get("collectives") or []) if c.get("start") is not None]
    for c in fsdp:
        segs.append(Segment(c["kind"], c["start"], c["end"], c.get("unit", "")))
        if c["kind"] == "reduce_scatter" or c.get("phase") == "backward":
            comm_iv.append((c["start"], c["end"]))
    step_s = float(rec.get("step_time_s") or max([s.end for s in segs], default=0.0))
    opt = rec.get("optimizer")
    timed = bool(opt and opt.get("start") is not None and opt.get("end") is not None)
    if timed:
        segs.append(Segment("optimizer", opt["start"], opt["end"], "optimizer.step()"))
    elif bw.get("returned") is not None:
        segs.append(Segment("optimizer", bw["returned"], step_s, "optimizer + bookkeeping (untimed split)"))
    if intervals:
        bw_start = _fnum(bw.get("start"))
        compute_end = _fnum(bw.get("compute_end")) or max(iv["end"] for iv in intervals)
    elif fsdp:
        fwd_ends = [s.end for s in segs if s.lane == "forward"]
        bw_start = max(fwd_ends) if fwd_ends else None
        compute_end = opt["start"] if timed else None
        if bw_start is not None and compute_end is not None and compute_end > bw_start:
            segs.append(Segment("backward", bw_start, compute_end, "backward (incl. FSDP waits)"))
    else:
        bw_start = compute_end = None
    comm_s = union_length(comm_iv)
    comm_end = max((e for _s, e in comm_iv), default=None)
    if comm_end is not None and compute_end is not None:
        exposed = max(0.0, comm_end - compute_end)
    else:
        exposed = comm_s
    hidden = max(0.0, comm_s - exposed)
    return RankTimeline(int(rec["rank"]), int(rec["step"]), rec.get("strategy", "ddp"), tuple(segs), step_s,
                        bw_start, compute_end, comm_s, comm_end, exposed, hidden, timed)


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once.

    Bucket all-reduces run one after another on one stream; a bucket launched
    while the previous one runs waits, so summing end − start would count
    that wait twice."""
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
