"""Communication (``%dp comm``, ``%dp bench allreduce``): α–β model vs real collectives.

The distributed story: an all-reduce over N ranks with a ring sends 2(N−1)/N
of the buffer from every rank in 2(N−1) steps; a reduce-scatter or an
all-gather (N−1)/N in N−1 steps.  Time ≈ steps × α + bytes per rank / β
(:func:`dpnb.core.collective_time`): latency dominates small messages,
bandwidth large ones.  nccl-tests report algbw = S/t and busbw = algbw ×
2(N−1)/N (all-reduce) or (N−1)/N (reduce-scatter, all-gather), which makes
busbw comparable to the link's β for any N.

The benchmark (:func:`bench`) runs the real collective on every live rank
(``dpnb.engine.metrics.views.bench_collective``) over a range of sizes; the view
plots its algbw/busbw on the same axes as the model and fits α and β to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ipywidgets as w

from dpnb.core import (LINKS, ConfigError, Link, algbw, bus_factor, busbw, collective_bytes,
                       collective_steps, collective_time)

from dpnb.engine import entrypoints as ep
from . import _common as C

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
KIND_LABEL = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}
KIND_COLOR = {"all_reduce": "#DD8452", "reduce_scatter": "#C44E52", "all_gather": "#55A868"}
#: Presets shown in the view (names of :data:`dpnb.core.LINKS`) with readable labels.
PRESETS = {
    "nvlink4-h100": "NVLink 4 (H100), 450 GB/s",
    "ib-ndr-400": "InfiniBand NDR 400 Gb/s",
    "ib-hdr-200": "InfiniBand HDR 200 Gb/s",
    "pcie-gen4-x16": "PCIe 4.0 x16",
    "ethernet-100g": "Ethernet 100 Gb/s",
    "gloo-loopback": "gloo over loopback (CPU)",
}
log_sizes = C.log_sizes  # ``%dp bench --sizes LO:HI:K`` → log_sizes(LO, HI, K)
BENCH_SIZES = log_sizes(1e3, 3.2e7, 8)


@dataclass(frozen=True)
class BenchResult:
    """A measured collective: per size (bytes, the nccl-tests S) the time in
    seconds (per iteration the slowest rank, then the median over iterations)."""

    kind: str
    world_size: int
    backend: str
    device: str
    sizes: tuple[int, ...]
    times_s: tuple[float, ...]
    iters: int

    @property
    def algbw(self) -> tuple[float, ...]:
        return tuple(algbw(s, t) for s, t in zip(self.sizes, self.times_s))

    @property
    def busbw(self) -> tuple[float, ...]:
        return tuple(busbw(self.kind, s, t, self.world_size) for s, t in zip(self.sizes, self.times_s))  # type: ignore[arg-type]


def bench_from_ranks(per_rank: list[dict]) -> BenchResult:
    """Combine each rank's ``bench_collective`` result: max over ranks per iteration, median over iterations."""
    if not per_rank:
        raise C.ViewError("no benchmark results")
    r0 = per_rank[0]
    times = []
    for i in range(len(r0["sizes"])):
        iters = len(r0["times"][i])
        per_iter = [max(r["times"][i][k] for r in per_rank) for k in range(iters)]
        per_iter.sort()
        m = len(per_iter)
        times.append(per_iter[m // 2] if m % 2 else 0.5 * (per_iter[m // 2 - 1] + per_iter[m // 2]))
    return BenchResult(r0["kind"], r0["world_size"], r0["backend"], r0["device"], tuple(r0["sizes"]),
                       tuple(times), len(r0["times"][0]) if r0["times"] else 0)


def spans_hosts(cluster) -> bool:
    """Whether the cluster's ranks run on more than one host (two links, not one)."""
    return len({r.host for r in cluster.ranks}) > 1


def bench(cluster, sizes=None, kind: str = "all_reduce", iters: int = 5, warmup: int = 1) -> BenchResult:
    """Run ``kind`` on every live rank for each size (bytes) and return the timings.

    Collective: all ranks take part (``cluster.call`` with ``ranks=None``).
    Each timed call is preceded by a barrier; a size's time is, per
    iteration, the slowest rank's, then the median over ``iters``.
    """
    if kind not in KINDS:
        raise C.ViewError(f"unknown collective {kind!r}: choose one of {', '.join(KINDS)}")
    sizes = [int(s) for s in (sizes or BENCH_SIZES)]
    res = C.call_ok(cluster, ep.BENCH_COLLECTIVE, sizes, kind, iters, warmup)
    return bench_from_ranks(res)


def fit_link(b: BenchResult, name: str = "fitted") -> Link | None:
    """α and β fitted to measured times: t = steps·α + bytes_per_rank/β.

    Weighted least squares on relative error (weights 1/t²), so small and
    large messages count alike; α is clamped at 0.  None when the data cannot
    determine a positive bandwidth (fewer than two sizes, or times that do
    not grow with size).
    """
    n = b.world_size
    if n < 2 or len(b.sizes) < 2:
        return None
    xs = [collective_bytes(b.kind, s, n) for s in b.sizes]  # type: ignore[arg-type]
    ts = list(b.times_s)
    ws = [1.0 / (t * t) for t in ts]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    mt = sum(w * t for w, t in zip(ws, ts)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxt = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts))
    if sxx <= 0:
        return None
    slope = sxt / sxx
    a = mt - slope * mx
    if a < 0:  # refit through the origin
        a = 0.0
        slope = sum(w * x * t for w, x, t in zip(ws, xs, ts)) / sum(w * x * x for w, x in zip(ws, xs))
    if slope <= 0:
        return None
    steps = collective_steps(b.kind, n)  # type: ignore[arg-type]
    return Link(name, 1.0 / slope, a / steps, f"fitted to {b.kind} on {n} ranks ({b.backend})")


@dataclass(frozen=True)
class Curve:
    kind: str
    sizes: tuple[float, ...]
    times_s: tuple[float, ...]
    algbw: tuple[float, ...]
    busbw: tuple[float, ...]


@dataclass(frozen=True)
class CommView:
    link: Link
    n: int
    curves: tuple[Curve, ...]
    bench: BenchResult | None = None
    fitted: Link | None = None
    table: tuple = field(default_factory=tuple)  # (size, {kind: time}) rows


def make_link(link: str | Link = "ib-ndr-400", bandwidth_gbs: float | None = None,
              latency_us: float | None = None) -> Link:
    """A preset from :data:`dpnb.core.LINKS`, optionally with bandwidth (GB/s,
    decimal, one direction) or latency (µs per step) overridden."""
    if isinstance(link, Link):
        base = link
    else:
        if link not in LINKS:
            raise ConfigError(f"unknown link {link!r}: choose one of {', '.join(LINKS)} "
                              "or give --bandwidth GB/s and --latency us")
        base = LINKS[link]
    if bandwidth_gbs is None and latency_us is None:
        return base
    return Link(f"{base.name} (custom)", (bandwidth_gbs * 1e9) if bandwidth_gbs else base.bandwidth_Bps,
                (latency_us * 1e-6) if latency_us is not None else base.latency_s, "user-set")


def data(link: str | Link = "ib-ndr-400", n: int = 8, collectives=KINDS, size_lo: float | None = None,
         size_hi: float | None = None, points: int = 43, bench: BenchResult | None = None,
         bandwidth_gbs: float | None = None, latency_us: float | None = None) -> CommView:
    """Model curves for each collective on ``link`` with ``n`` ranks, and the benchmark if given.

    Sizes (bytes) run from ``size_lo`` to ``size_hi``: 1 kB to 10 GB by
    default, around the benchmark's range when one is given."""
    lk = make_link(link, bandwidth_gbs, latency_us)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ConfigError(f"n must be an integer ≥ 2 ranks (one rank communicates nothing), got {n!r}")
    kinds = [k for k in KINDS if k in set(collectives)]
    if not kinds:
        raise ConfigError(f"choose at least one collective of {', '.join(KINDS)}")
    if bench is not None:
        size_lo = size_lo or min(bench.sizes) / 3
        size_hi = size_hi or max(bench.sizes) * 3
    size_lo, size_hi = size_lo or 1e3, size_hi or 1e10
    if not 0 < size_lo < size_hi:
        raise ConfigError(f"need 0 < smallest size < largest size, got {size_lo!r}, {size_hi!r}")
    sizes = [float(s) for s in C.log_sizes(size_lo, size_hi, points)]
    curves = []
    for k in kinds:
        ts = [collective_time(k, s, n, lk) for s in sizes]  # type: ignore[arg-type]
        curves.append(Curve(k, tuple(sizes), tuple(ts), tuple(s / t for s, t in zip(sizes, ts)),
                            tuple(s / t * bus_factor(k, n) for s, t in zip(sizes, ts))))  # type: ignore[arg-type]
    table = []
    for s in (1e6, 1e8, 1e9):
        table.append((s, {k: collective_time(k, s, n, lk) for k in kinds}))  # type: ignore[arg-type]
    fitted = fit_link(bench) if bench is not None else None
    return CommView(lk, n, tuple(curves), bench, fitted, tuple(table))


# ----------------------------------------------------------------- output
def _model_rows(d: CommView) -> list[list[str]]:
    return [[C.fmt_bytes(s)] + [C.fmt_ms(t[k]) for k in (c.kind for c in d.curves)] for s, t in d.table]


def _bench_rows(d: CommView) -> list[list[str]]:
    b = d.bench
    assert b is not None
    rows = []
    ref = d.fitted or d.link
    for s, t, a, bb in zip(b.sizes, b.times_s, b.algbw, b.busbw):
        model = collective_time(b.kind, s, b.world_size, d.link)  # type: ignore[arg-type]
        rows.append([C.fmt_bytes(s), C.fmt_ms(t), f"{a / 1e9:.3g}", f"{bb / 1e9:.3g}", C.fmt_ms(model),
                     f"{t / model:.2g}×", C.fmt_ms(collective_time(b.kind, s, b.world_size, ref))])  # type: ignore[arg-type]
    return rows


BENCH_HEADERS = ("size", "measured", "algbw GB/s", "busbw GB/s", "model (preset)", "measured/model", "fitted α–β")


def _summary(d: CommView) -> list[str]:
    lk = d.link
    lines = [f"link {lk.name}: β = {lk.bandwidth_Bps / 1e9:g} GB/s per rank one way, α = {lk.latency_s * 1e6:g} µs "
             f"per step; N = {d.n} ranks. Ring: all-reduce sends 2(N−1)/N·S = {2 * (d.n - 1) / d.n:.3g}·S per rank "
             f"in {2 * (d.n - 1)} steps; RS/AG (N−1)/N·S = {(d.n - 1) / d.n:.3g}·S in {d.n - 1} step"
             + ("s" if d.n > 2 else "")]
    if lk.note:
        lines.append(lk.note)
    if d.bench is not None:
        b = d.bench
        lines.append(f"benchmark: {KIND_LABEL[b.kind]} on {b.world_size} live ranks ({b.backend}, {b.device}), "
                     f"{b.iters} iterations per size, slowest rank per iteration, median")
        if d.fitted is not None:
            lines.append(f"fitted: β = {d.fitted.bandwidth_Bps / 1e9:.3g} GB/s, α = {d.fitted.latency_s * 1e6:.3g} µs "
                         f"per step (busbw at the largest size {b.busbw[-1] / 1e9:.3g} GB/s)")
    return lines


def text(d: CommView) -> str:
    out = ["Collective communication (α–β model)"] + ["  " + s for s in _summary(d)]
    out += ["", C.text_table(["size"] + [KIND_LABEL[c.kind] for c in d.curves], _model_rows(d))]
    if d.bench is not None:
        out += ["", C.text_table(BENCH_HEADERS, _bench_rows(d))]
    return "\n".join(out)


def html(d: CommView) -> str:
    out = C.html_lines(_summary(d))
    out += C.html_table(["size"] + [KIND_LABEL[c.kind] for c in d.curves], _model_rows(d),
                        f"Model time on {d.link.name}, N={d.n}")
    if d.bench is not None:
        out += C.html_table(BENCH_HEADERS, _bench_rows(d), "Benchmark (decimal units: 1 GB/s = 10⁹ B/s)")
    return out


def figure(d: CommView):
    """Left: time vs message size; right: algbw/busbw vs size.  Lines: model;
    markers: the benchmark (filled busbw, open algbw); dashed: the fitted α–β."""
    fig = C.new_figure(4.4)
    ax, ax2 = fig.subplots(1, 2)
    kinds = {c.kind for c in d.curves}
    for c in d.curves:
        col = KIND_COLOR[c.kind]
        same = c.kind == "reduce_scatter" and "all_gather" in kinds
        lw = 4 if same else 1.6
        alpha = 0.45 if same else 1.0
        name = KIND_LABEL[c.kind] + (" (= all-gather)" if same else "")
        ax.plot(c.sizes, [t * 1e3 for t in c.times_s], color=col, lw=lw, alpha=alpha, label=f"{name} model")
        ax2.plot(c.sizes, [b / 1e9 for b in c.busbw], color=col, lw=lw, alpha=alpha, label=f"{name} busbw model")
        ax2.plot(c.sizes, [b / 1e9 for b in c.algbw], color=col, lw=lw, alpha=alpha, ls=":",
                 label=f"{name} algbw model")
    b = d.bench
    if b is not None:
        col = KIND_COLOR[b.kind]
        ax.plot(b.sizes, [t * 1e3 for t in b.times_s], "o", color=col, mec="black", ms=5,
                label=f"{KIND_LABEL[b.kind]} measured, N={b.world_size}")
        ax2.plot(b.sizes, [x / 1e9 for x in b.busbw], "o", color=col, mec="black", ms=5, label="measured busbw")
        ax2.plot(b.sizes, [x / 1e9 for x in b.algbw], "o", mfc="none", mec=col, ms=5, label="measured algbw")
        if d.fitted is not None:
            sizes = [float(s) for s in C.log_sizes(min(b.sizes), max(b.sizes), 30)]
            ax.plot(sizes, [collective_time(b.kind, s, b.world_size, d.fitted) * 1e3 for s in sizes],  # type: ignore[arg-type]
                    "--", color="black", lw=1,
                    label=f"fitted: β={d.fitted.bandwidth_Bps / 1e9:.3g} GB/s, α={d.fitted.latency_s * 1e6:.3g} µs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes, log)")
    ax.set_ylabel("time (ms, log)")
    ax.set_title(f"Collective time, N = {d.n} ranks, {PRESETS.get(d.link.name, d.link.name)}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.minorticks_off()  # log axes: minor ticks cost more to draw than everything else
    ax.legend(fontsize=7, loc="upper left")
    ax2.axhline(d.link.bandwidth_Bps / 1e9, color="gray", lw=0.8, ls="--")
    ax2.text(min(c.sizes[0] for c in d.curves), d.link.bandwidth_Bps / 1e9,
             f" link β = {d.link.bandwidth_Bps / 1e9:g} GB/s", va="bottom", fontsize=7, color="gray")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("message size S (bytes, log)")
    ax2.set_ylabel("bandwidth (GB/s = 10⁹ B/s, log)")
    ax2.set_title("algbw = S / t,  busbw = algbw × bus factor", fontsize=10)
    ax2.grid(True, which="major", alpha=0.3)
    ax2.minorticks_off()
    ax2.legend(fontsize=7, loc="lower right")
    return fig


def view(cluster=None, *, link: str = "ib-ndr-400", n: int = 8, collectives=KINDS, bench: BenchResult | None = None,
         run_bench: bool = False, sizes=None, kind: str = "all_reduce", iters: int = 5):
    """The comm widget: link preset, N, collectives; with ``bench`` (or
    ``run_bench=True`` on a live ``cluster``) the measured points overlaid.
    A live cluster sets N to its world size and the link to gloo-loopback
    when it runs on CPU."""

    if cluster is not None:
        n = cluster.world_size
        if cluster.backend == "gloo" and link == "ib-ndr-400" and not spans_hosts(cluster):
            link = "gloo-loopback"
        if run_bench and bench is None:
            bench = globals()["bench"](cluster, sizes, kind, iters)
    if bench is not None:
        n = bench.world_size
    state = {"bench": bench}
    controls = {
        "link": C.dropdown("link", [(PRESETS.get(k, k), k) for k in LINKS], link),
        "n": C.int_slider("ranks N", max(2, n), 2, 1024),
        "collectives": w.SelectMultiple(options=[(KIND_LABEL[k], k) for k in KINDS], value=tuple(collectives),
                                        description="collectives", rows=3,
                                        style={"description_width": "110px"}, layout=w.Layout(width="300px")),
        "bandwidth_gbs": C.float_text("β override GB/s", 0.0),
        "latency_us": C.float_text("α override µs", -1.0),
    }
    extra = []
    if cluster is not None:
        btn = w.Button(description="run benchmark", tooltip="all ranks run the collective (%dp bench allreduce)")
        extra.append(btn)

    def compute(v: dict) -> CommView:
        return data(v["link"], v["n"], v["collectives"], bench=state["bench"],
                    bandwidth_gbs=v["bandwidth_gbs"] or None,
                    latency_us=v["latency_us"] if v["latency_us"] >= 0 else None)

    title = "Collective communication" + (" (live)" if cluster is not None else "")
    if cluster is not None and spans_hosts(cluster):
        # one fit across hosts mixes loopback and network: point at the view that separates them
        title += f" -- {len({r.host for r in cluster.ranks})} hosts: %dp bench allreduce measures each link"
    box = C.viewbox(title, controls, compute,
                    figure, html, text, extra=extra,
                    layout_rows=[["link", "n", "collectives"], ["bandwidth_gbs", "latency_us"]])
    if extra:
        def on_click(_b):
            state["bench"] = globals()["bench"](cluster, sizes, kind, iters)
            box.controls["n"].value = state["bench"].world_size
            box.refresh()

        extra[0].on_click(on_click)
    return box


def _args(kw: dict) -> dict:
    keys = ("link", "n", "collectives", "bench", "bandwidth_gbs", "latency_us")
    return {k: kw[k] for k in keys if k in kw}


def show(cluster=None, **kw: Any) -> None:
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        if cluster is not None:
            kw.setdefault("n", cluster.world_size)
            if kw.get("run_bench") and kw.get("bench") is None:
                kw["bench"] = bench(cluster, kw.get("sizes"), kw.get("kind", "all_reduce"), kw.get("iters", 5))
            if cluster.backend == "gloo" and not spans_hosts(cluster):
                kw.setdefault("link", "gloo-loopback")
        if kw.get("bench") is not None:
            kw["n"] = kw["bench"].world_size
        print(text(data(**_args(kw))))


def show_bench(cluster, sizes=None, kind: str = "all_reduce", iters: int = 5, link: str | None = None) -> BenchResult:
    """``%dp bench allreduce``: run the benchmark, show it over the model, return the result."""
    b = bench(cluster, sizes, kind, iters)
    lk = link or ("gloo-loopback" if b.backend == "gloo" else "nvlink4-h100")
    if C._in_kernel():
        C.show_view(view(link=lk, n=b.world_size, collectives=(kind,), bench=b))
    else:
        print(text(data(lk, b.world_size, (kind,), bench=b)))
    return b


def save(path: str, cluster=None, **kw: Any) -> str:
    """The view as a figure at ``path``; ``cluster`` (as every view's ``save`` takes
    it) gives the number of ranks when ``n`` is not said."""
    if cluster is not None:
        kw.setdefault("n", cluster.world_size)
    return C.save_figure(figure(data(**_args(kw))), path)

