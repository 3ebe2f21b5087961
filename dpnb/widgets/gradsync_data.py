"""The gradient-sync view's data layer: per-rank timelines from the engines'
records, bucket rows, and the overlap model's prediction beside them.

Pure functions of recorded dicts (see :func:`dpnb.engine.metrics.watch.gradsync_records`)
and :mod:`dpnb.core`; drawing lives in :mod:`dpnb.widgets.gradsync`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpnb.core import (
    LINKS,
    Link,
    Timeline,
    collective_bytes,
    collective_steps,
    ddp_bucket_caps,
    ddp_buckets,
    initial_ddp_buckets,
    overlap_timeline,
)
from dpnb.core.comm import fit_link_ols
from dpnb.core.strategies import is_fsdp
from dpnb.core.synctimeline import (  # noqa: F401  (re-exported: the view's names)
    RankTimeline,
    Segment,
    rank_timeline,
    union_length,
)

from . import _common as C

COMM_LANES = ("all_reduce", "all_gather", "reduce_scatter")
LANE_LABEL = {"forward": "forward", "backward": "backward", "all_reduce": "all-reduce",
              "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "optimizer": "optimizer"}
NO_RECORDS = ("no recorded steps: run %dp train first, without --no-record (the default "
              "keeps each call's last step and every 10th)")


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
    sent: int | None = None  # bytes this rank sent for it (a comm hook compresses); None: bytes

    @property
    def wire_bytes(self) -> int:
        return self.bytes if self.sent is None else self.sent

    @property
    def compressed(self) -> bool:
        return self.wire_bytes != self.bytes


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
    comm_hook: str = "none"  # how DDP sent the buckets (dpnb.engine.train.commhook)

    @property
    def compressed(self) -> bool:
        return any(b.compressed for b in self.buckets)


# ------------------------------------------------------------------ data
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
        sent = b.get("sent_bytes")
        out.append(BucketRow(int(b["index"]), len(b.get("params", [])), int(b["bytes"]), rank_of[i], t,
                             float(b["start"]), float(end), tuple(b.get("params", [])),
                             None if sent is None else int(sent)))
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
        if r.end_s > begin and r.wire_bytes > 0:  # a compressed bucket moves fewer bytes
            sizes.append(r.wire_bytes)
            times.append(r.end_s - begin)
    if not sizes or n < 2:
        return None

    return fit_link_ols([collective_bytes("all_reduce", sz, n) for sz in sizes], times,
                        collective_steps("all_reduce", n), "bucket all-reduces",
                        "time over all buckets")


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
    """The gradsync view from each rank's step records (``dpnb.engine.metrics.views.gradsync_records``).

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
    fsdp = is_fsdp(strategy)
    if not any(r.segments for r in ranks):
        raise C.ViewError(
            f"step {step} has no timeline: " + ("FSDP collectives are only timed after "
                                               "dpnb.widgets.gradsync.watch(cluster) (%dp gradsync --watch); "
                                               "run it, then %dp train again" if fsdp else NO_RECORDS))
    if not any(r.optimizer_timed for r in ranks):
        notes.append("optimizer step not separately timed (its bar includes the per-step stats all-gather): "
                     "run %dp gradsync --watch before %dp train")
    rows = bucket_rows(r0) if not fsdp else []
    hook = str(r0.get("comm_hook") or "none")
    compressed = any(r.compressed for r in rows)
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
        elif compressed:
            # a compressed bucket's time is mostly the hook's own work, not bytes / β
            lk, source = LINKS["gloo-loopback"], "gloo-loopback (buckets were compressed: no fit)"
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
        if compressed:
            comparison.append(f"compressed buckets: measured {C.fmt_ms(rt.comm_s)} of all-reduce; the model "
                              f"puts the same buckets, uncompressed, at {C.fmt_ms(tl.comm_s)} on {lk.name}")
        else:
            comparison += _measured_vs_model(rt, pred, other)
    return GradsyncView(strategy, ws, int(step), ranks, tuple(rows), colls, lk, source, measured_cap, pred, other,
                        tuple(comparison), tuple(notes), hook)


def _measured_vs_model(rt: RankTimeline, pred: Prediction, other: Prediction | None) -> list[str]:
    """Rank 0's measured all-reduce times beside the model's, and the model at the slider's cap."""
    tl = pred.timeline
    comparison = [_cmp("total all-reduce time", rt.comm_s, tl.comm_s)]
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
    return comparison
