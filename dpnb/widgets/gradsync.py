"""Gradient sync (``%dp gradsync``): when each bucket's all-reduce ran, against backward.

The distributed story: DDP groups gradients into buckets (about
``bucket_cap_mb``, 25 MiB by default with a 1 MiB first bucket, rebuilt after
the first step in the order gradients became ready) and launches a bucket's
asynchronous all-reduce as soon as autograd has produced all of its
gradients, so the all-reduce of the last layers' gradients runs while
backward is still computing the first layers'.  What is not hidden that way
is *exposed*: it runs after backward's compute and lengthens the step.
Then every rank runs the same optimizer step.  Under FSDP2 (zero2/zero3)
there are no buckets: each unit's parameters are all-gathered before its
forward (and again before its backward under zero3) and its gradients are
reduce-scattered after its backward.

Measured: per rank, from the training layer's bucket recorder (DDP comm hook
timestamps, per-parameter gradient-ready hooks) and, when
:func:`watch` was installed before training, forward / optimizer-step times
and FSDP's all-gathers and reduce-scatters.  Model: the same parameters,
bucketed by :func:`dpnb.core.ddp_buckets` in the measured ready order, with
the measured backward time per bucket and an α–β link fitted to the measured
bucket all-reduces (:func:`dpnb.core.overlap_timeline`) -- at the measured
cap and at another cap chosen with the slider.  Where measurement and model
disagree the view says by how much.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpnb.core import (
    LINKS,
    Link,
    Timeline,
    ddp_bucket_caps,
    ddp_buckets,
    initial_ddp_buckets,
    overlap_timeline,
)
from . import _common as C

COMM_LANES = ("all_reduce", "all_gather", "reduce_scatter")
LANE_LABEL = {"forward": "forward", "backward": "backward", "all_reduce": "all-reduce",
              "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "optimizer": "optimizer"}
NO_RECORDS = ("no recorded steps: run %dp train with recording on first "
              "(dpnb.engine.training.train(ns, ..., record=True), the default)")


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


@dataclass(frozen=True)
class BucketRow:
    index: int
    n_params: int
    bytes: int
    ready_order: int
    ready_s: float | None
    start_s: float
    end_s: float
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """The model at one bucket cap: buckets and the overlap timeline (times from backward start)."""

    cap_mb: float | None
    first_cap_bytes: int
    cap_bytes: int
    bucket_bytes: tuple[int, ...]
    bucket_params: tuple[int, ...]
    backward_s: tuple[float, ...]
    timeline: Timeline
    offset_s: float  # backward start in the measured step, to draw on the same axis

    @property
    def label(self) -> str:
        return "default (1 MiB first, 25 MiB)" if self.cap_mb is None else f"{self.cap_mb:g} MiB"


@dataclass(frozen=True)
class GradsyncView:
    strategy: str
    world_size: int
    step: int
    ranks: tuple[RankTimeline, ...]
    buckets: tuple[BucketRow, ...]
    collectives: tuple[tuple, ...]  # FSDP: (rank, kind, phase, unit, bytes, start, end)
    link: Link | None
    link_source: str
    measured_cap_mb: float | None
    predicted: Prediction | None
    other: Prediction | None
    comparison: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


# ------------------------------------------------------------------ data
def _fnum(x) -> float | None:
    return None if x is None else float(x)


def rank_timeline(rec: dict) -> RankTimeline:
    """Segments and overlap numbers of one rank's step record (see ``dpnb.engine.views.gradsync_records``)."""
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


def _ready_order(rec: dict) -> tuple[list[int], dict[int, float]]:
    """Parameter indices (registration order) in the order their gradients became
    ready, and each one's ready time (its backward interval's end)."""
    names = list(rec.get("param_order") or rec.get("param_bytes", {}).keys())
    pos = {n: i for i, n in enumerate(names)}
    order: list[int] = []
    ready: dict[int, float] = {}
    for iv in (rec.get("backward") or {}).get("intervals") or []:
        for n in iv.get("params", []):
            if n in pos and pos[n] not in ready:
                order.append(pos[n])
                ready[pos[n]] = float(iv["end"])
    rest = [i for i in reversed(range(len(names))) if i not in ready]
    return order + rest, ready


def bucket_rows(rec: dict) -> list[BucketRow]:
    """The measured bucket table of one rank's step: index, #params, bytes, ready order."""
    _order, ready = _ready_order(rec)
    names = list(rec.get("param_order") or rec.get("param_bytes", {}).keys())
    pos = {n: i for i, n in enumerate(names)}
    rows = []
    for b in rec.get("buckets") or []:
        ts = [ready[pos[p]] for p in b.get("params", []) if p in pos and pos[p] in ready]
        rows.append((b, max(ts) if ts else None))
    by_ready = sorted(range(len(rows)), key=lambda i: (rows[i][1] is None, rows[i][1] or 0.0, rows[i][0]["index"]))
    rank_of = {i: k for k, i in enumerate(by_ready)}
    out = []
    for i, (b, t) in enumerate(rows):
        end = b["end"] if b.get("end") is not None else b["start"]
        out.append(BucketRow(int(b["index"]), len(b.get("params", [])), int(b["bytes"]), rank_of[i], t,
                             float(b["start"]), float(end), tuple(b.get("params", []))))
    return sorted(out, key=lambda r: r.index)


def fitted_link(rows: list[BucketRow], n: int) -> Link | None:
    """α–β fitted to the measured bucket all-reduces (reproduces their total time).

    A bucket's own duration is end − max(start, previous bucket's end): DDP
    runs them one after another, so a bucket launched while the previous one
    was still running waits first.  With three or more distinct bucket sizes
    α and β come from least squares; otherwise (or if that gives α < 0)
    α = 0 and β = bytes sent per rank / time."""
    rows = sorted(rows, key=lambda r: r.start_s)
    sizes, times = [], []
    prev_end = None
    for r in rows:
        begin = r.start_s if prev_end is None else max(r.start_s, prev_end)
        prev_end = r.end_s
        if r.end_s > begin and r.bytes > 0:
            sizes.append(r.bytes)
            times.append(r.end_s - begin)
    if not sizes or n < 2:
        return None
    from dpnb.core import collective_bytes, collective_steps

    xs = [collective_bytes("all_reduce", sz, n) for sz in sizes]
    if len(set(sizes)) >= 3:
        # Ordinary least squares: its residuals sum to zero, so the fitted
        # link reproduces the total measured all-reduce time.
        k = len(xs)
        mx, mt = sum(xs) / k, sum(times) / k
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, times)) / sxx if sxx else 0.0
        a = mt - slope * mx
        if slope > 0 and a >= 0:
            return Link("fitted", 1.0 / slope, a / collective_steps("all_reduce", n),
                        f"least squares over {k} bucket all-reduces")
    return Link("fitted", sum(xs) / sum(times), 0.0, "β = bytes / time over all buckets (α = 0)")


def predict(rec: dict, cap_mb: float | None, link: Link, n: int) -> Prediction:
    """Model buckets and overlap timeline at ``cap_mb`` from one rank's measured step."""
    names = list(rec.get("param_order") or rec["param_bytes"].keys())
    pbytes = [int(rec["param_bytes"][nm]) for nm in names]
    order, ready = _ready_order(rec)
    first, cap = ddp_bucket_caps(cap_mb)
    if rec.get("initial_buckets"):
        # the first DDP iteration still uses the construction-time buckets
        buckets = initial_ddp_buckets(pbytes, cap, first)
    else:
        buckets = ddp_buckets(pbytes, cap, first, order=order)
    bw = rec.get("backward") or {}
    start = float(bw.get("start") or 0.0)
    known = [t for t in ready.values()]
    last_known = max(known) if known else start
    prev = start
    back = []
    for b in buckets:
        ts = [ready[i] for i in b.param_indices if i in ready]
        t = max(ts) if ts else last_known
        back.append(max(0.0, t - prev))
        prev = max(prev, t)
    tl = overlap_timeline([b.nbytes for b in buckets], back, link, n)
    return Prediction(cap_mb, first, cap, tuple(b.nbytes for b in buckets), tuple(len(b.param_indices) for b in buckets),
                      tuple(back), tl, start)


def _cmp(what: str, measured: float, model: float, tol_s: float = 5e-5, rel: float = 0.05) -> str:
    d = measured - model
    if abs(d) < 1e-9:
        return f"{what}: measured {C.fmt_ms(measured)}, model {C.fmt_ms(model)}: agree"
    if abs(d) <= tol_s or (model and abs(d) / abs(model) <= rel):
        return f"{what}: measured {C.fmt_ms(measured)}, model {C.fmt_ms(model)}: agree (within {C.fmt_ms(abs(d))})"
    how = "model under-predicts" if d > 0 else "model over-predicts"
    pct = f", {abs(d) / abs(model):.0%}" if model else ""
    return f"{what}: measured {C.fmt_ms(measured)}, model {C.fmt_ms(model)}: {how} by {C.fmt_ms(abs(d))}{pct}"


def data(records: list[dict], *, step: int | None = None, cap_mb: float | None = None,
         link: str | Link | None = None) -> GradsyncView:
    """The gradsync view from each rank's step records (``dpnb.engine.views.gradsync_records``).

    ``records``: a flat list of per-rank step dicts; ``step``: which step
    (default: the latest recorded on every rank); ``cap_mb``: another bucket
    cap to predict (MiB, as DDP's ``bucket_cap_mb``); ``link``: a
    :data:`dpnb.core.LINKS` name or Link for the model instead of the α–β
    fitted to the measured buckets.
    """
    if not records:
        raise C.ViewError(NO_RECORDS)
    by_step: dict[int, dict[int, dict]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = r
    ws = int(records[0].get("world_size", len(by_step[max(by_step)])))
    full = [s for s, rs in by_step.items() if len(rs) == ws] or list(by_step)
    if step is None:
        step = max(full)
    if step not in by_step:
        raise C.ViewError(f"step {step} was not recorded; recorded steps: {sorted(by_step)}")
    recs = [by_step[step][r] for r in sorted(by_step[step])]
    strategy = recs[0].get("strategy", "ddp")
    ranks = tuple(rank_timeline(r) for r in recs)
    r0 = recs[0]
    notes: list[str] = []
    fsdp = strategy in ("zero2", "zero3")
    if not any(r.segments for r in ranks):
        raise C.ViewError(
            f"step {step} has no timeline: " + ("FSDP collectives are only timed after "
                                               "dpnb.widgets.gradsync.watch(cluster) (%dp gradsync --watch); "
                                               "run it, then %dp train again" if fsdp else NO_RECORDS))
    if not any(r.optimizer_timed for r in ranks):
        notes.append("optimizer step not separately timed (its bar includes the per-step stats all-gather): "
                     "run %dp gradsync --watch before %dp train")
    rows = bucket_rows(r0) if not fsdp else []
    colls = tuple((rec["rank"], c["kind"], c.get("phase", ""), c.get("unit", ""), c["bytes"], c["start"], c["end"])
                  for rec in recs for c in (rec.get("collectives") or []) if c.get("start") is not None)
    measured_cap = r0.get("bucket_cap_mb")
    lk: Link | None = None
    source = ""
    pred = other = None
    comparison: list[str] = []
    if fsdp:
        notes.append("FSDP has no DDP buckets: each unit all-gathers its parameters before forward (and before "
                     "backward under zero3) and reduce-scatters its gradients after backward; the bucket cap "
                     "does not apply")
        notes.append("under FSDP the forward/backward bars include the waits on all-gathers, so hidden vs exposed "
                     "communication is not separated")
    elif rows:
        if isinstance(link, Link):
            lk, source = link, link.name
        elif link:
            if link not in LINKS:
                raise C.ViewError(f"unknown link {link!r}: choose one of {', '.join(LINKS)}, or leave it out to fit "
                                  "α–β to the measured buckets")
            lk, source = LINKS[link], link
        else:
            lk = fitted_link(rows, ws)
            source = "fitted to the measured bucket all-reduces"
            if lk is None:
                lk, source = LINKS["gloo-loopback"], "gloo-loopback (no bucket could be timed)"
        pred = predict(r0, measured_cap, lk, ws)
        if cap_mb is not None and cap_mb != measured_cap:
            other = predict(r0, cap_mb, lk, ws)
        rt = ranks[0]
        nb_m, nb_p = len(rows), len(pred.bucket_bytes)
        same = [r.bytes for r in rows] == list(pred.bucket_bytes)
        comparison.append(f"buckets: measured {nb_m}, model {nb_p}" + (" (same sizes)" if same else
                          f" (sizes differ: measured {[r.bytes for r in rows]} B, model {list(pred.bucket_bytes)} B)"))
        tl = pred.timeline
        comparison.append(_cmp("total all-reduce time", rt.comm_s, tl.comm_s))
        if rt.comm_end is not None and rt.backward_start is not None:
            comparison.append(_cmp("last all-reduce ends (from backward start)", rt.comm_end - rt.backward_start,
                                   tl.overlapped_s))
        comparison.append(_cmp("exposed communication", rt.exposed_s, tl.exposed_comm_s))
        if other is not None:
            nb = len(other.bucket_bytes)
            comparison.append(f"at {other.label}: {nb} bucket{'s' if nb != 1 else ''}, exposed "
                              f"{C.fmt_ms(other.timeline.exposed_comm_s)} vs {C.fmt_ms(tl.exposed_comm_s)} at the "
                              f"measured cap ({pred.label}); backward+sync "
                              f"{C.fmt_ms(other.timeline.overlapped_s)} vs {C.fmt_ms(tl.overlapped_s)}")
    return GradsyncView(strategy, ws, int(step), ranks, tuple(rows), colls, lk, source, measured_cap, pred, other,
                        tuple(comparison), tuple(notes))


def watch(cluster) -> list[dict]:
    """Install the timing hooks on every rank (forward, optimizer step, FSDP collectives); no communication.

    Call after ``%dp wrap`` and before ``%dp train``; ``%dp gradsync --watch``."""
    return C.call_ok(cluster, "dpnb.engine.views.watch")


def fetch(cluster, last: int = 3) -> list[dict]:
    """The last ``last`` recorded steps of every rank (flat list; no communication)."""
    try:
        per = C.call_ok(cluster, "dpnb.engine.views.gradsync_records", last)
    except C.ViewError as e:
        if "no model is wrapped" in str(e):
            raise C.ViewError(NO_RECORDS + " (no model is wrapped yet: %dp wrap MODEL first)") from None
        raise
    flat = [r for rs in per for r in rs]
    if not flat:
        raise C.ViewError(NO_RECORDS)
    return flat


# ----------------------------------------------------------------- output
BUCKET_HEADERS = ("bucket", "#params", "bytes", "ready order", "ready at", "all-reduce start", "end", "duration")


def bucket_table(d: GradsyncView) -> list[list[str]]:
    return [[str(b.index), str(b.n_params), f"{b.bytes:,}", str(b.ready_order),
             C.fmt_ms(b.ready_s), C.fmt_ms(b.start_s), C.fmt_ms(b.end_s), C.fmt_ms(b.end_s - b.start_s)]
            for b in d.buckets]


COLL_HEADERS = ("rank", "collective", "phase", "unit", "bytes", "start", "end")


def coll_table(d: GradsyncView) -> list[list[str]]:
    return [[str(r), k, ph, u, f"{b:,}", C.fmt_ms(s), C.fmt_ms(e)] for r, k, ph, u, b, s, e in d.collectives]


def _summary(d: GradsyncView) -> list[str]:
    lines = [f"step {d.step}, {d.strategy}, {d.world_size} ranks"
             + (f", bucket_cap_mb={d.measured_cap_mb if d.measured_cap_mb is not None else 'default (25, first 1)'}"
                if d.strategy in ("ddp", "zero1") else "")]
    for r in d.ranks:
        if d.strategy in ("zero2", "zero3"):
            ag = sum(s.duration for s in r.lane("all_gather"))
            rs = sum(s.duration for s in r.lane("reduce_scatter"))
            lines.append(f"rank {r.rank}: step {C.fmt_ms(r.step_s)}; all-gathers {len(r.lane('all_gather'))} "
                         f"({C.fmt_ms(ag)}), reduce-scatters {len(r.lane('reduce_scatter'))} ({C.fmt_ms(rs)})")
        else:
            lines.append(f"rank {r.rank}: step {C.fmt_ms(r.step_s)}; {len(r.lane('all_reduce'))} bucket all-reduces, "
                         f"{C.fmt_ms(r.comm_s)} of communication: {C.fmt_ms(r.hidden_s)} overlapped with backward "
                         f"({r.overlap_fraction:.0%}), {C.fmt_ms(r.exposed_s)} exposed")
    if d.link is not None:
        lines.append(f"model link: {d.link.name}, β {d.link.bandwidth_Bps / 1e9:.3g} GB/s, α {d.link.latency_s * 1e6:.3g} µs"
                     f" ({d.link_source})")
    lines += list(d.comparison)
    return lines


def text(d: GradsyncView) -> str:
    out = ["Gradient synchronization"] + ["  " + s for s in _summary(d)] + ["  note: " + n for n in d.notes]
    if d.buckets:
        out += ["", C.text_table(BUCKET_HEADERS, bucket_table(d))]
    if d.collectives:
        out += ["", C.text_table(COLL_HEADERS, coll_table(d))]
    return "\n".join(out)


def html(d: GradsyncView) -> str:
    out = C.html_lines(_summary(d), [f"note: {n}" for n in d.notes])
    if d.buckets:
        out += C.html_table(BUCKET_HEADERS, bucket_table(d), "Buckets (rank 0; bucket 0 is all-reduced first)")
    if d.collectives:
        out += C.html_table(COLL_HEADERS, coll_table(d), "FSDP collectives")
    return out


def _lanes_for(r: RankTimeline) -> list[str]:
    present = {s.lane for s in r.segments}
    return [ln for ln in ("forward", "backward", "all_reduce", "all_gather", "reduce_scatter", "optimizer")
            if ln in present]


def figure(d: GradsyncView):
    """Top: measured lanes per rank (forward, backward per module, each bucket's
    all-reduce or FSDP's all-gathers/reduce-scatters, optimizer step); the
    exposed part of communication is shaded red.  Bottom: the model at the
    measured bucket cap (and at the slider's cap)."""
    lanes: list[tuple[int, str]] = [(r.rank, ln) for r in d.ranks for ln in _lanes_for(r)]
    preds = [p for p in (d.predicted, d.other) if p is not None]
    n_pred = 2 * len(preds)
    h = 1.3 + 0.28 * len(lanes) + (0.9 + 0.28 * n_pred if preds else 0)
    fig = C.new_figure(max(3.2, h))
    if preds:
        ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[len(lanes) + 1.5, n_pred + 1.2])
    else:
        ax, ax2 = fig.subplots(1, 1), None
    yl = []
    queued_y: list = []
    by_rank = {r.rank: r for r in d.ranks}
    for y, (rank, ln) in enumerate(lanes):
        r = by_rank[rank]
        segs = r.lane(ln)
        if ln == "all_reduce":
            colors = [C.COLORS["all_reduce"] if (s.index or 0) % 2 == 0 else C.COLORS["all_reduce_alt"] for s in segs]
            waits = [s for s in r.segments if s.lane == ln and s.queued]
            if waits:
                queued_y.append((y, waits))
        elif ln == "backward":
            colors = ["#4C72B0" if k % 2 == 0 else "#7A9BD0" for k in range(len(segs))]
        else:
            colors = [C.COLORS.get(ln if ln != "optimizer" else "optimizer_step", "gray")] * len(segs)
        C.barh(ax, [(s.start * 1e3, max(s.duration, 0) * 1e3) for s in segs], y, facecolors=colors,
               edgecolor="white", linewidth=0.5)
        if ln == "all_reduce":
            span = max((x.end for x in r.segments), default=1.0)
            for s in segs:
                if s.duration > 0.03 * span and s.index is not None:
                    ax.text((s.start + s.end) / 2 * 1e3, y, str(s.index), ha="center", va="center", fontsize=7,
                            bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
        if ln in COMM_LANES and r.compute_end is not None and r.comm_end is not None and r.comm_end > r.compute_end \
                and d.strategy in ("ddp", "zero1"):
            ax.broken_barh([(r.compute_end * 1e3, (r.comm_end - r.compute_end) * 1e3)], (y - 0.45, 0.9),
                           facecolors="none", edgecolor=C.COLORS["exposed"], hatch="////", linewidth=1)
        yl.append(f"rank {rank} {LANE_LABEL[ln]}")
    for y, waits in queued_y:  # drawn last, as a thin bar along the lane's lower edge
        C.barh(ax, [(s.start * 1e3, s.duration * 1e3) for s in waits], y + 0.3, height=0.16,
               facecolors=C.COLORS["wait"], edgecolor="#808080", linewidth=0.5)
    for r in d.ranks:
        ax.axvline(r.step_s * 1e3, color="gray", lw=0.6, ls=":")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(yl, fontsize=8)
    ax.set_ylim(len(lanes) - 0.4, -0.6)
    from matplotlib.patches import Patch

    fsdp = d.strategy in ("zero2", "zero3")
    handles = [Patch(color=C.COLORS["backward"],
                     label="backward (incl. FSDP waits)" if fsdp else "backward (per module)")]
    if any(s.lane == "forward" for r in d.ranks for s in r.segments):
        handles.insert(0, Patch(color=C.COLORS["forward"], label="forward"))
    if d.strategy in ("zero2", "zero3"):
        handles += [Patch(color=C.COLORS["all_gather"], label="all-gather"),
                    Patch(color=C.COLORS["reduce_scatter"], label="reduce-scatter")]
    else:
        handles += [Patch(color=C.COLORS["all_reduce"], label="bucket all-reduce (index)"),
                    Patch(facecolor=C.COLORS["wait"], edgecolor="#b0b0b0", label="queued behind previous"),
                    Patch(facecolor="none", edgecolor=C.COLORS["exposed"], hatch="////", label="exposed comm")]
    handles.append(Patch(color=C.COLORS["optimizer_step"], label="optimizer step"))
    ax.legend(handles=handles, fontsize=7.5, ncol=min(len(handles), 4), loc="lower left", bbox_to_anchor=(0, 1.0),
              frameon=False, handlelength=1.2, columnspacing=1.0)
    ax.set_title(f"Measured: step {d.step}, {d.strategy}, {d.world_size} ranks (dotted: step end)", fontsize=10,
                 pad=8 + 11 * ((len(handles) + 3) // 4))
    ax.grid(True, axis="x", alpha=0.3)
    if ax2 is not None:
        y = 0
        yl2 = []
        for p in preds:
            off = p.offset_s
            C.barh(ax2, [((off + iv.start) * 1e3, iv.duration * 1e3) for iv in p.timeline.compute], y,
                   facecolors=["#4C72B0" if k % 2 == 0 else "#7A9BD0" for k in range(len(p.timeline.compute))],
                   edgecolor="white", linewidth=0.5)
            C.barh(ax2, [((off + iv.start) * 1e3, iv.duration * 1e3) for iv in p.timeline.comm], y + 1,
                   facecolors=[C.COLORS["all_reduce"] if k % 2 == 0 else C.COLORS["all_reduce_alt"]
                               for k in range(len(p.timeline.comm))], edgecolor="white", linewidth=0.5)
            if p.timeline.exposed_comm_s > 0:
                ax2.broken_barh([((off + p.timeline.compute_s) * 1e3, p.timeline.exposed_comm_s * 1e3)],
                                (y + 1 - 0.45, 0.9), facecolors="none", edgecolor=C.COLORS["exposed"], hatch="////")
            tag = "model @ measured cap" if p is d.predicted else "model @ slider cap"
            yl2 += [f"{tag} {p.label}: backward", f"{len(p.bucket_bytes)} bucket all-reduce{'s' if len(p.bucket_bytes) != 1 else ''}"]
            y += 2
        ax2.set_yticks(range(y))
        ax2.set_yticklabels(yl2, fontsize=7.5)
        ax2.set_ylim(y - 0.4, -0.6)
        ax2.set_title(f"Model: same ready order and backward times, link {d.link.name if d.link else '?'} "
                      f"(β {d.link.bandwidth_Bps / 1e9:.3g} GB/s, α {d.link.latency_s * 1e6:.3g} µs)"
                      if d.link else "Model", fontsize=9)
        ax2.grid(True, axis="x", alpha=0.3)
        ax2.set_xlabel("time from step start (ms)")
    else:
        ax.set_xlabel("time from step start (ms)")
    return fig


# ----------------------------------------------------------------- widget
def view(cluster=None, *, records: list[dict] | None = None, last: int = 3, step: int | None = None,
         cap_mb: float | None = None, link: str | None = None):
    """The gradsync widget: step chooser, a bucket-cap slider for the model's
    prediction at another cap, a link chooser (fitted or a preset)."""
    if records is None:
        if cluster is None:
            raise C.ViewError("give records=... (from dpnb.widgets.gradsync.fetch(cluster)) or a live cluster")
        records = fetch(cluster, last)
    d0 = data(records, step=step, cap_mb=cap_mb, link=link)
    steps = sorted({int(r["step"]) for r in records})
    meas_cap = d0.measured_cap_mb
    default_other = cap_mb if cap_mb is not None else (meas_cap * 4 if meas_cap else 100.0)
    controls = {
        "step": C.dropdown("step", steps, d0.step),
        "cap_mb": C.log_slider("bucket cap MiB", default_other, -3, 3, 0.05),
        "link": C.dropdown("model link", [("fitted to measured", "")] + [(k, k) for k in LINKS], link or ""),
    }
    if d0.strategy in ("zero2", "zero3"):
        controls["cap_mb"].disabled = True
        controls["link"].disabled = True

    def compute(v: dict) -> GradsyncView:
        return data(records, step=v["step"], cap_mb=v["cap_mb"] if d0.strategy in ("ddp", "zero1") else None,
                    link=v["link"] or None)

    return C.viewbox("Gradient synchronization" + (" (live)" if cluster is not None else ""), controls, compute,
                     figure, html, text)


def show(cluster=None, **kw: Any) -> None:
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        recs = kw.pop("records", None) or fetch(cluster, kw.pop("last", 3))
        kw.pop("last", None)
        print(text(data(recs, **kw)))


def save(path: str, cluster=None, **kw: Any) -> str:
    recs = kw.pop("records", None) or fetch(cluster, kw.pop("last", 3))
    kw.pop("last", None)
    return C.save_figure(figure(data(recs, **kw)), path)


__all__ = ["data", "figure", "text", "html", "view", "show", "save", "fetch", "watch", "predict", "rank_timeline",
           "bucket_rows", "fitted_link", "GradsyncView", "RankTimeline", "BucketRow", "Prediction", "Segment"]
