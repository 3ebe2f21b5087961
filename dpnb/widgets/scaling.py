"""Scaling (``%dp scaling``): throughput and efficiency vs DP degree.

The distributed story: with N ranks each step does the same per-rank compute
as one rank plus a gradient all-reduce whose ring cost 2(N−1)/N·S/β does not
shrink with N; the part of it not hidden behind backward (``overlap``) adds
to every step, so throughput grows slower than N (weak scaling: fixed batch
per rank).  Numbers from :func:`dpnb.core.scaling` with
:func:`dpnb.core.allreduce_comm`.  With a live cluster, each world size that
was trained gives a measured point (median samples/s of its recorded steps).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from matplotlib.ticker import FuncFormatter, LogLocator

from dpnb.core import ConfigError, Link, ScalingPoint, allreduce_comm, scaling

from dpnb.engine import entrypoints as ep
from . import _common as C
from .comm import PRESETS, make_link


@dataclass(frozen=True)
class Measured:
    """One measured world size: median samples/s and compute time of its steps."""

    dp: int
    samples_per_s: float
    compute_s: float | None = None
    steps: int = 0


@dataclass(frozen=True)
class ScalingView:
    points: tuple[ScalingPoint, ...]
    compute_s: float
    grad_bytes: float
    link: Link
    overlap: float
    samples_per_rank: int
    measured: tuple[Measured, ...] = ()
    base_throughput: float = 0.0  # one rank, model
    notes: tuple[str, ...] = field(default_factory=tuple)

    def point(self, dp: int) -> ScalingPoint:
        for p in self.points:
            if p.dp == dp:
                return p
        raise KeyError(dp)


def dp_degrees(max_dp: int) -> list[int]:
    out, n = [], 1
    while n <= max_dp:
        out.append(n)
        n *= 2
    if out[-1] != max_dp:
        out.append(max_dp)
    return out


def data(compute_ms: float = 200.0, grad_bytes: float = 2e9, link: str | Link = "ib-ndr-400",
         overlap: float = 0.6, max_dp: int = 256, samples_per_rank: int = 8, measured=None,
         degrees: list[int] | None = None, note: str | None = None) -> ScalingView:
    """Model points for DP = 1, 2, 4, … ``max_dp`` (or ``degrees``), plus measured points.

    ``compute_ms``: one rank's forward+backward+optimizer time per step;
    ``grad_bytes``: gradient bytes all-reduced per step; ``overlap``: the
    fraction of the all-reduce hidden behind backward (see the gradsync
    view); ``measured``: ``{dp: samples_per_s}`` or a list of
    :class:`Measured`.
    """
    if not compute_ms > 0:
        raise ConfigError(f"compute time must be > 0 ms, got {compute_ms!r}")
    if not grad_bytes >= 0:
        raise ConfigError(f"gradient bytes must be ≥ 0, got {grad_bytes!r}")
    lk = make_link(link)
    degs = sorted(set(degrees or dp_degrees(int(max_dp))))
    ms = _measured(measured)
    degs = sorted(set(degs) | {m.dp for m in ms})
    pts = scaling(degs, compute_ms / 1e3, allreduce_comm(float(grad_bytes), lk), float(overlap), int(samples_per_rank))
    return ScalingView(tuple(pts), compute_ms / 1e3, float(grad_bytes), lk, float(overlap), int(samples_per_rank),
                       tuple(ms), samples_per_rank / (compute_ms / 1e3), (note,) if note else ())


def _measured(measured) -> list[Measured]:
    """``{dp: samples_per_s}``, ``{dp: Measured}``, or a list of Measured / (dp, samples_per_s)."""
    if not measured:
        return []
    out = []
    pairs = measured.items() if isinstance(measured, dict) else [(None, m) for m in measured]
    for k, m in pairs:
        if isinstance(m, Measured):
            out.append(m)
        elif k is not None:
            out.append(Measured(int(k), float(m)))
        else:
            out.append(Measured(int(m[0]), float(m[1])))
    return sorted(out, key=lambda m: m.dp)


def measured_from_records(records: list[dict]) -> list[Measured]:
    """Median samples/s (and slowest-rank compute) per world size, from step records.

    The first step of each world size is skipped when there are more (it
    includes DDP's bucket rebuild and allocator warm-up).
    """
    by: dict[int, list[dict]] = {}
    for r in records:
        if r.get("samples_per_s"):
            by.setdefault(int(r["dp"]), []).append(r)
    out = []
    for dp, rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["step"])
        if len(rs) > 1:
            rs = rs[1:]
        comp = [max(r["compute_s_all"]) for r in rs if r.get("compute_s_all")]
        out.append(Measured(dp, statistics.median(r["samples_per_s"] for r in rs),
                            statistics.median(comp) if comp else None, len(rs)))
    return out


def fetch(cluster) -> tuple[list[Measured], dict]:
    """Measured points from rank 0's step records, and the live settings
    (compute time, gradient bytes, samples per rank) to calibrate the model."""
    recs = C.call_ok(cluster, ep.RECORDS, ranks=[0])[0]
    summ = C.call_ok(cluster, ep.LIVE_SUMMARY, ranks=[0])[0]
    ms = measured_from_records(recs)
    live: dict = {"link": "gloo-loopback" if cluster.backend == "gloo" else "nvlink4-h100"}
    if summ.get("grad_bytes"):
        live["grad_bytes"] = float(summ["grad_bytes"])
    if recs:
        last = recs[-1]
        live["samples_per_rank"] = int(last["micro_batch"] * last["grad_accum"])
        same = sorted(r["step_time_s"] for r in recs if r["dp"] == last["dp"] and r.get("step_time_s"))
        if same:
            # Calibrate per-rank compute with the measured step time at this world size: an upper
            # bound (it includes that step's exposed communication and bookkeeping), so the model
            # at this DP sits at or below the measured point by about the predicted exposed comm.
            live["compute_ms"] = same[len(same) // 2] * 1e3
            live["calibrated"] = f"compute = median measured step time at DP={last['dp']}"
    return ms, live


# ----------------------------------------------------------------- output
HEADERS = ("DP", "step (ms)", "compute (ms)", "comm (ms)", "exposed (ms)", "samples/s", "speedup", "efficiency",
           "measured samples/s")


def rows(d: ScalingView) -> list[list[str]]:
    meas = {m.dp: m for m in d.measured}
    out = []
    for p in d.points:
        m = meas.get(p.dp)
        out.append([str(p.dp), f"{p.step_s * 1e3:.4g}", f"{p.compute_s * 1e3:.4g}", f"{p.comm_s * 1e3:.4g}",
                    f"{p.exposed_comm_s * 1e3:.4g}", f"{p.throughput:,.4g}", f"{p.speedup:.3g}×",
                    f"{p.efficiency:.1%}", f"{m.samples_per_s:,.4g}" if m else ""])
    return out


def _summary(d: ScalingView) -> list[str]:
    lines = [f"compute {d.compute_s * 1e3:.4g} ms/step per rank, {C.fmt_bytes(d.grad_bytes)} of gradients "
             f"all-reduced on {PRESETS.get(d.link.name, d.link.name)} (β {d.link.bandwidth_Bps / 1e9:g} GB/s, "
             f"α {d.link.latency_s * 1e6:g} µs), {d.overlap:.0%} of it overlapped with backward, "
             f"{d.samples_per_rank} samples per rank per step (weak scaling)"]
    last = d.points[-1]
    lines.append(f"at DP={last.dp}: {last.throughput:,.4g} samples/s, speedup {last.speedup:.3g}×, "
                 f"efficiency {last.efficiency:.1%}")
    lines += list(d.notes)
    for m in d.measured:
        p = d.point(m.dp)
        lines.append(f"measured DP={m.dp}: {m.samples_per_s:,.4g} samples/s vs model {p.throughput:,.4g} "
                     f"({m.samples_per_s / p.throughput - 1:+.0%})")
    return lines


def text(d: ScalingView) -> str:
    return "\n".join(["Scaling with DP degree"] + ["  " + s for s in _summary(d)]
                     + ["", C.text_table(HEADERS, rows(d))])


def html(d: ScalingView) -> str:
    return C.html_lines(_summary(d)) + C.html_table(HEADERS, rows(d), "Model per DP degree")


def figure(d: ScalingView):
    """Throughput vs DP (ideal, model, measured); efficiency vs DP; step-time
    breakdown (compute + exposed comm, hidden comm shown hatched)."""
    fig = C.new_figure(4.2)
    ax, ax2, ax3 = fig.subplots(1, 3)
    dps = [p.dp for p in d.points]
    ax.plot(dps, [d.base_throughput * n for n in dps], "--", color="gray", label="ideal (linear)")
    ax.plot(dps, [p.throughput for p in d.points], "o-", color=C.COLORS["model"], ms=4, label="model")
    if d.measured:
        ax.plot([m.dp for m in d.measured], [m.samples_per_s for m in d.measured], "D", color=C.COLORS["measured"],
                mec="black", ms=7, label="measured", zorder=5)

    dp_fmt = FuncFormatter(lambda v, _p: f"{v:g}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(dp_fmt)
    ax.set_yscale("log")

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.set_xlabel("DP degree (ranks, log₂)")
    ax.set_ylabel("throughput (samples/s, log)")
    ax.set_title("Throughput", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    ax.minorticks_off()

    ax2.plot(dps, [p.efficiency * 100 for p in d.points], "o-", color=C.COLORS["model"], ms=4, label="model")
    if d.measured:
        ax2.plot([m.dp for m in d.measured], [m.samples_per_s / (m.dp * d.base_throughput) * 100 for m in d.measured],
                 "D", color=C.COLORS["measured"], mec="black", ms=7, label="measured (vs model 1 rank)")
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_formatter(dp_fmt)
    effs = [m.samples_per_s / (m.dp * d.base_throughput) * 100 for m in d.measured]
    ax2.set_ylim(0, max([105.0] + [e * 1.08 for e in effs]))
    ax2.set_xlabel("DP degree (ranks, log₂)")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_title("Efficiency = speedup / DP", fontsize=10)
    ax2.legend(fontsize=8, loc="lower left")
    ax2.grid(True, alpha=0.3)
    ax2.minorticks_off()

    x = list(range(len(d.points)))
    comp = [p.compute_s * 1e3 for p in d.points]
    exp = [p.exposed_comm_s * 1e3 for p in d.points]
    hid = [(p.comm_s - p.exposed_comm_s) * 1e3 for p in d.points]
    ax3.bar(x, comp, 0.7, color=C.COLORS["backward"], label="compute")
    ax3.bar(x, exp, 0.7, bottom=comp, color=C.COLORS["exposed"], label="exposed comm")
    ax3.bar(x, hid, 0.7, bottom=[c - h for c, h in zip(comp, hid)], facecolor="none", edgecolor="#0b1f3a",
            hatch="///", lw=0, label=f"hidden comm ({d.overlap:.0%} overlap)")
    ax3.set_xticks(x)
    ax3.set_xticklabels([str(n) for n in dps], fontsize=7 if len(dps) > 10 else 8,
                        rotation=90 if len(dps) > 10 else 0)
    ax3.set_xlabel("DP degree")
    ax3.set_ylabel("step time (ms)")
    ax3.set_title("Step time per rank", fontsize=10)
    ax3.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax3.grid(True, axis="y", alpha=0.3)
    return fig


def view(cluster=None, *, compute_ms: float = 200.0, grad_bytes: float = 2e9, link: str = "ib-ndr-400",
         overlap: float = 0.6, max_dp: int = 256, samples_per_rank: int = 8, measured=None):
    """The scaling widget; with ``cluster`` the measured point(s) and the live
    compute time / gradient size / link are filled in."""
    if cluster is not None:
        ms, live = fetch(cluster)
        measured = list(_measured(measured)) + [m for m in ms if m.dp not in {x.dp for x in _measured(measured)}]
        compute_ms = live.get("compute_ms", compute_ms)
        grad_bytes = live.get("grad_bytes", grad_bytes)
        link = live.get("link", link)
        samples_per_rank = live.get("samples_per_rank", samples_per_rank)
        max_dp = max(max_dp if max_dp != 256 else 16, cluster.world_size)
    note = live.get("calibrated") if cluster is not None else None
    meas = _measured(measured)
    controls = {
        "compute_ms": C.log_slider("compute (ms)", compute_ms, -2, 4, 0.05),
        "grad_bytes": C.log_slider("grad bytes", grad_bytes, 3, 12, 0.05),
        "link": C.dropdown("link", [(PRESETS.get(k, k), k) for k in PRESETS], link if link in PRESETS else "ib-ndr-400"),
        "overlap": C.float_slider("overlap", overlap, 0, 1, 0.05, fmt=".2f"),
        "max_dp": C.int_slider("max DP", max_dp, 2, 4096),
        "samples_per_rank": C.int_slider("samples/rank", samples_per_rank, 1, 1024),
    }

    def compute(v: dict) -> ScalingView:
        return data(v["compute_ms"], v["grad_bytes"], v["link"], v["overlap"], v["max_dp"], v["samples_per_rank"],
                    meas, note=note)

    return C.viewbox("Scaling with DP degree" + (" (live)" if cluster is not None else ""), controls, compute,
                     figure, html, text)


def _args(kw: dict) -> dict:
    keys = ("compute_ms", "grad_bytes", "link", "overlap", "max_dp", "samples_per_rank", "measured", "degrees")
    out = {k: kw[k] for k in keys if k in kw}
    if kw.get("calibrated"):
        out["note"] = kw["calibrated"]
    return out


def _live_kw(cluster, kw: dict) -> dict:
    if cluster is None:
        return kw
    ms, live = fetch(cluster)
    out = {**live, **kw}
    out["measured"] = list(_measured(kw.get("measured"))) + ms
    out.setdefault("max_dp", max(16, cluster.world_size))
    return out


def show(cluster=None, **kw: Any) -> None:
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        print(text(data(**_args(_live_kw(cluster, kw)))))


def save(path: str, cluster=None, **kw: Any) -> str:
    return C.save_figure(figure(data(**_args(_live_kw(cluster, kw)))), path)
