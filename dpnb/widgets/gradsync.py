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

from typing import Any

from matplotlib.patches import Patch

from dpnb.core import (
    LINKS,
)
from dpnb.core.strategies import is_ddp, is_fsdp

from dpnb.engine import entrypoints as ep
from . import _common as C
from .gradsync_data import (  # noqa: F401  (the view's data layer, re-exported)
    COMM_LANES,
    LANE_LABEL,
    NO_RECORDS,
    BucketRow,
    GradsyncView,
    Prediction,
    RankTimeline,
    Segment,
    _cmp,
    _ready_order,
    bucket_rows,
    data,
    fitted_link,
    predict,
    rank_timeline,
    union_length,
)


def watch(cluster) -> list[dict]:
    """Install the timing hooks on every rank (forward, optimizer step, FSDP collectives); no communication.

    Call after ``%dp wrap`` and before ``%dp train``; ``%dp gradsync --watch``."""
    return C.call_ok(cluster, ep.WATCH)


def fetch(cluster, last: int = 3) -> list[dict]:
    """The last ``last`` recorded steps of every rank (flat list; no communication)."""
    try:
        per = C.call_ok(cluster, ep.GRADSYNC_RECORDS, last)
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


def bucket_headers(d: GradsyncView) -> tuple[str, ...]:
    """With a compressing comm hook, a "sent" column beside the bucket's bytes."""
    return BUCKET_HEADERS[:3] + ("sent",) + BUCKET_HEADERS[3:] if d.compressed else BUCKET_HEADERS


def bucket_table(d: GradsyncView) -> list[list[str]]:
    return [[str(b.index), str(b.n_params), f"{b.bytes:,}"]
            + ([f"{b.wire_bytes:,}"] if d.compressed else [])
            + [str(b.ready_order), C.fmt_ms(b.ready_s), C.fmt_ms(b.start_s), C.fmt_ms(b.end_s),
               C.fmt_ms(b.end_s - b.start_s)]
            for b in d.buckets]


COLL_HEADERS = ("rank", "collective", "phase", "unit", "bytes", "start", "end")


def coll_table(d: GradsyncView) -> list[list[str]]:
    shown = shown_ranks(d)  # at 32 ranks, every rank's FSDP collectives would be hundreds of rows
    return [[str(r), k, ph, u, f"{b:,}", C.fmt_ms(s), C.fmt_ms(e)] for r, k, ph, u, b, s, e in d.collectives
            if r in shown]


#: above this many ranks, lanes and per-rank lines are drawn for a few ranks only
LANES_ABOVE = 4


def shown_ranks(d: GradsyncView) -> dict[int, str]:
    """``{rank: role}`` of the ranks whose lanes are drawn: all of them up to
    :data:`LANES_ABOVE`; beyond, rank 0, the slowest and fastest step, and the
    most exposed communication (32 ranks × 4 lanes would be unreadable; the
    spread over all ranks goes in the summary)."""
    if len(d.ranks) <= LANES_ABOVE:
        return {r.rank: "" for r in d.ranks}
    by_step = sorted(d.ranks, key=lambda r: r.step_s)
    roles: dict[int, list[str]] = {d.ranks[0].rank: []}
    roles.setdefault(by_step[-1].rank, []).append("slowest")
    roles.setdefault(by_step[0].rank, []).append("fastest")
    if any(r.exposed_s > 0 for r in d.ranks):
        roles.setdefault(max(d.ranks, key=lambda r: r.exposed_s).rank, []).append("most exposed")
    return {r: ", ".join(v) for r, v in sorted(roles.items())}


def _spread(d: GradsyncView) -> str:
    """One line over all ranks: min / median / max of step time and exposed communication."""
    def mmm(xs):
        xs = sorted(xs)
        return f"{C.fmt_ms(xs[0])} / {C.fmt_ms(xs[len(xs) // 2])} / {C.fmt_ms(xs[-1])}"

    slow = max(d.ranks, key=lambda r: r.step_s)
    fast = min(d.ranks, key=lambda r: r.step_s)
    return (f"all {len(d.ranks)} ranks, min / median / max: step {mmm([r.step_s for r in d.ranks])} "
            f"(slowest rank {slow.rank}, fastest rank {fast.rank}); exposed communication "
            f"{mmm([r.exposed_s for r in d.ranks])}")


def _summary(d: GradsyncView) -> list[str]:
    lines = [f"step {d.step}, {d.strategy}, {d.world_size} ranks"
             + (f", bucket_cap_mb={d.measured_cap_mb if d.measured_cap_mb is not None else 'default (25, first 1)'}"
                if is_ddp(d.strategy) else "")]
    shown = shown_ranks(d)
    if len(shown) < len(d.ranks):
        lines.append(_spread(d))
    for r in (r for r in d.ranks if r.rank in shown):
        if is_fsdp(d.strategy):
            ag = sum(s.duration for s in r.lane("all_gather"))
            rs = sum(s.duration for s in r.lane("reduce_scatter"))
            lines.append(f"rank {r.rank}: step {C.fmt_ms(r.step_s)}; all-gathers {len(r.lane('all_gather'))} "
                         f"({C.fmt_ms(ag)}), reduce-scatters {len(r.lane('reduce_scatter'))} ({C.fmt_ms(rs)})")
        else:
            lines.append(f"rank {r.rank}: step {C.fmt_ms(r.step_s)}; {len(r.lane('all_reduce'))} bucket all-reduces, "
                         f"{C.fmt_ms(r.comm_s)} of communication: {C.fmt_ms(r.hidden_s)} overlapped with backward "
                         f"({r.overlap_fraction:.0%}), {C.fmt_ms(r.exposed_s)} exposed")
    if d.compressed:
        raw, sent = sum(b.bytes for b in d.buckets), sum(b.wire_bytes for b in d.buckets)
        lines.append(f"comm hook {d.comm_hook}: {sent:,} of {raw:,} gradient bytes sent "
                     f"({sent / raw:.0%})")
    if d.link is not None:
        lines.append(f"model link: {d.link.name}, β {d.link.bandwidth_Bps / 1e9:.3g} GB/s, α {d.link.latency_s * 1e6:.3g} µs"
                     f" ({d.link_source})")
    lines += list(d.comparison)
    return lines


def text(d: GradsyncView) -> str:
    out = ["Gradient synchronization"] + ["  " + s for s in _summary(d)] + ["  note: " + n for n in d.notes]
    if d.buckets:
        out += ["", C.text_table(bucket_headers(d), bucket_table(d))]
    if d.collectives:
        out += ["", C.text_table(COLL_HEADERS, coll_table(d))]
    return "\n".join(out)


def html(d: GradsyncView) -> str:
    out = C.html_lines(_summary(d), [f"note: {n}" for n in d.notes])
    if d.buckets:
        out += C.html_table(bucket_headers(d), bucket_table(d), "Buckets (rank 0; bucket 0 is all-reduced first)")
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
    shown = shown_ranks(d)
    lanes: list[tuple[int, str]] = [(r.rank, ln) for r in d.ranks if r.rank in shown for ln in _lanes_for(r)]
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
                and is_ddp(d.strategy):
            ax.broken_barh([(r.compute_end * 1e3, (r.comm_end - r.compute_end) * 1e3)], (y - 0.45, 0.9),
                           facecolors="none", edgecolor=C.COLORS["exposed"], hatch="////", linewidth=1)
        yl.append(f"rank {rank}{f' ({shown[rank]})' if shown[rank] else ''} {LANE_LABEL[ln]}")
    for y, waits in queued_y:  # drawn last, as a thin bar along the lane's lower edge
        C.barh(ax, [(s.start * 1e3, s.duration * 1e3) for s in waits], y + 0.3, height=0.16,
               facecolors=C.COLORS["wait"], edgecolor="#808080", linewidth=0.5)
    for r in d.ranks:
        if r.rank in shown:
            ax.axvline(r.step_s * 1e3, color="gray", lw=0.6, ls=":")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(yl, fontsize=8)
    ax.set_ylim(len(lanes) - 0.4, -0.6)

    fsdp = is_fsdp(d.strategy)
    handles = [Patch(color=C.COLORS["backward"],
                     label="backward (incl. FSDP waits)" if fsdp else "backward (per module)")]
    if any(s.lane == "forward" for r in d.ranks for s in r.segments):
        handles.insert(0, Patch(color=C.COLORS["forward"], label="forward"))
    if is_fsdp(d.strategy):
        handles += [Patch(color=C.COLORS["all_gather"], label="all-gather"),
                    Patch(color=C.COLORS["reduce_scatter"], label="reduce-scatter")]
    else:
        handles += [Patch(color=C.COLORS["all_reduce"], label="bucket all-reduce (index)"),
                    Patch(facecolor=C.COLORS["wait"], edgecolor="#b0b0b0", label="queued behind previous"),
                    Patch(facecolor="none", edgecolor=C.COLORS["exposed"], hatch="////", label="exposed comm")]
    handles.append(Patch(color=C.COLORS["optimizer_step"], label="optimizer step"))
    ax.legend(handles=handles, fontsize=7.5, ncol=min(len(handles), 4), loc="lower left", bbox_to_anchor=(0, 1.0),
              frameon=False, handlelength=1.2, columnspacing=1.0)
    some = f"; lanes of {len(shown)} of them" if len(shown) < len(d.ranks) else ""
    ax.set_title(f"Measured: step {d.step}, {d.strategy}, {d.world_size} ranks{some} (dotted: step end)", fontsize=10,
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
    if is_fsdp(d0.strategy):
        controls["cap_mb"].disabled = True
        controls["link"].disabled = True

    def compute(v: dict) -> GradsyncView:
        return data(records, step=v["step"], cap_mb=v["cap_mb"] if is_ddp(d0.strategy) else None,
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
