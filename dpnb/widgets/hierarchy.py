"""Intra-host vs inter-host links, and flat vs two-level all-reduce (``%dp bench hierarchical``).

On a cluster that spans hosts, one all-reduce benchmark mixes two links: the
ranks of a host talk over loopback / NVLink, the hosts over the network.  A
single α–β fit to it (or a one-host preset beside it) describes neither.  So
this view runs :func:`dpnb.engine.metrics.hierbench.bench_hierarchical` on every
rank: it measures each link on its own (an all-reduce inside every host at
once; one across hosts among the ranks of each local rank, all at once),
fits α and β to each, and sets the flat ring and the two-level algorithm
(intra-host reduce-scatter, inter-host all-reduce of S/g, intra-host
all-gather) beside :func:`dpnb.core.hierarchical_allreduce_time` with those
two fitted links.

On one host, ``--hosts K`` splits the ranks into K pretend hosts: the
mechanics are the same, the links are not (every "link" is loopback).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dpnb.core import HierarchicalAllReduce, Link, hierarchical_allreduce_time

from dpnb.engine import entrypoints as ep
from . import _common as C
from .comm import BenchResult, fit_link

HIER_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
PHASES = ("flat", "intra", "inter", "reduce_scatter", "all_reduce", "all_gather", "two_level")
PHASE_LABEL = {"reduce_scatter": "intra-host reduce-scatter", "all_reduce": "inter-host all-reduce of S/g",
               "all_gather": "intra-host all-gather"}


@dataclass(frozen=True)
class HierBench:
    """Measured times (seconds; per iteration the slowest rank, then the
    median) for each size S (bytes) and each entry of :data:`PHASES`."""

    hosts: int
    per_host: int
    backend: str
    device: str
    sizes: tuple[int, ...]
    times_s: tuple[tuple[str, tuple[float, ...]], ...]
    iters: int
    equal: bool  # both algorithms gave the exact same sum on every rank
    pretend: bool  # hosts split from one real host (--hosts K)

    def t(self, phase: str) -> tuple[float, ...]:
        return dict(self.times_s)[phase]


def layout(cluster, hosts: int | None = None) -> tuple[list[int], bool]:
    """The host index of every rank, and whether it is a pretend split."""
    n = cluster.world_size
    if hosts is None:
        lay = [r.node_rank for r in cluster.ranks]
        if len(set(lay)) < 2:
            raise C.ViewError(f"all {n} ranks are on one host: a two-level all-reduce needs two or more "
                              "hosts (on one machine, pretend with %dp bench hierarchical --hosts K)")
        return lay, False
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 2 or n % hosts:
        raise C.ViewError(f"--hosts must divide the {n} ranks into 2 or more equal hosts, got {hosts!r}")
    return [r // (n // hosts) for r in range(n)], True


def from_ranks(per_rank: list[dict], pretend: bool = False) -> HierBench:
    r0 = per_rank[0]
    med = []
    for p in PHASES:
        per_size = []
        for i in range(len(r0["sizes"])):
            k = len(r0["times"][p][i])
            per_size.append(statistics.median(max(r["times"][p][i][j] for r in per_rank) for j in range(k)))
        med.append((p, tuple(per_size)))
    return HierBench(r0["hosts"], r0["per_host"], r0["backend"], r0["device"], tuple(r0["sizes"]),
                     tuple(med), len(r0["times"]["flat"][0]), all(r["equal"] for r in per_rank), pretend)


def bench(cluster, sizes=None, iters: int = 3, hosts: int | None = None) -> HierBench:
    """Run the two-level benchmark on every rank (collective)."""
    lay, pretend = layout(cluster, hosts)
    res = C.call_ok(cluster, ep.BENCH_HIERARCHICAL,
                    [int(s) for s in (sizes or HIER_SIZES)], lay, iters, 1)
    return from_ranks(res, pretend)


def links(hb: HierBench) -> tuple[Link | None, Link | None]:
    """α–β fitted to each link alone: the intra-host all-reduce of S over g
    ranks, and the inter-host all-reduce of S/g over the hosts (each rank's
    share while all g ranks of a host send)."""
    intra = inter = None
    if hb.per_host > 1:
        intra = fit_link(BenchResult("all_reduce", hb.per_host, hb.backend, hb.device, hb.sizes,
                                     hb.t("intra"), hb.iters), "intra-host (fitted)")
    inter = fit_link(BenchResult("all_reduce", hb.hosts, hb.backend, hb.device,
                                 tuple(s // hb.per_host for s in hb.sizes), hb.t("inter"), hb.iters),
                     "inter-host per rank (fitted)")
    return intra, inter


@dataclass(frozen=True)
class HierView:
    bench: HierBench
    intra: Link | None
    inter: Link | None
    shared_nic: bool
    model: tuple[HierarchicalAllReduce | None, ...]  # per size; None without fitted links


def data(hb: HierBench) -> HierView:
    intra, inter = links(hb)
    # CPU hosts: the g ranks of a host share its one network link
    shared = hb.backend == "gloo"
    model: list[HierarchicalAllReduce | None] = []
    for s in hb.sizes:
        if inter is None:
            model.append(None)
            continue
        model.append(hierarchical_allreduce_time(s, hb.hosts, hb.per_host, intra or inter, inter,
                                                 shared_nic=shared))
    return HierView(hb, intra, inter, shared, tuple(model))


def _link_line(name: str, lk: Link | None) -> str:
    if lk is None:
        return f"{name}: not fitted (too few sizes, or times that do not grow with size)"
    return f"{name}: β = {lk.bandwidth_Bps / 1e6:.4g} MB/s, α = {lk.latency_s * 1e6:.3g} µs per step"


def summary(d: HierView) -> list[str]:
    b = d.bench
    where = "pretend hosts split from one machine" if b.pretend else "hosts"
    lines = [f"{b.hosts} {where} × {b.per_host} ranks ({b.backend}, {b.device}), {b.iters} iterations per size, "
             "slowest rank per iteration, median",
             _link_line(f"intra-host link (all-reduce inside each host, {b.per_host} ranks)", d.intra),
             _link_line(f"inter-host link (all-reduce of S/{b.per_host} across {b.hosts} hosts, "
                        "per rank while a host's ranks all send)", d.inter),
             "two-level and flat sums equal on every rank" if b.equal
             else "WARNING: two-level and flat sums differ"]
    if b.per_host > 1:
        # the model's reduce-scatter is a ring moving (g-1)/g of S, half an all-reduce
        ratio = statistics.median(rs / ar for rs, ar in zip(b.t("reduce_scatter"), b.t("intra")) if ar > 0)
        lines.append(f"measured: the intra-host reduce-scatter took {ratio:.2g}× the intra-host all-reduce "
                     "of the same buffer (a ring reduce-scatter would take about half)")
    if d.shared_nic:
        lines.append("model: a host's ranks share one network link, so the flat ring's single "
                     f"crossing stream per host gets {b.per_host}× the per-rank share")
    return lines


HEADERS = ("size", "flat", "flat model", "two-level", "two-level model", "RS / AR / AG measured",
           "RS / AR / AG model", "speedup", "speedup model")


def rows(d: HierView) -> list[list[str]]:
    b = d.bench
    out = []
    for i, s in enumerate(b.sizes):
        m = d.model[i]
        flat, two = b.t("flat")[i], b.t("two_level")[i]
        phases = " / ".join(C.fmt_ms(b.t(p)[i]) for p in ("reduce_scatter", "all_reduce", "all_gather"))
        out.append([C.fmt_bytes(s), C.fmt_ms(flat), C.fmt_ms(m.flat_ring_s) if m else "-", C.fmt_ms(two),
                    C.fmt_ms(m.total_s) if m else "-", phases,
                    " / ".join(C.fmt_ms(t) for t in (m.intra_reduce_scatter_s, m.inter_all_reduce_s,
                                                      m.intra_all_gather_s)) if m else "-",
                    f"{flat / two:.2f}×", f"{m.speedup:.2f}×" if m else "-"])
    return out


def text(d: HierView) -> str:
    return "\n".join(["Flat vs two-level all-reduce"] + ["  " + s for s in summary(d)]
                     + ["", C.text_table(HEADERS, rows(d))])


def html(d: HierView) -> str:
    return C.html_lines(summary(d), warn=[] if d.bench.equal else ["two-level and flat sums differ"]) \
        + C.html_table(HEADERS, rows(d), "Measured beside the α–β model with the fitted links")


def figure(d: HierView):
    """Left: time vs size, measured (markers) and model (lines) for both
    algorithms; right: the largest size's phases, measured beside model."""
    b = d.bench
    fig = C.new_figure(4.2)
    ax, ax2 = fig.subplots(1, 2)
    ms = [t * 1e3 for t in b.t("flat")]
    ax.plot(b.sizes, ms, "o", color="#DD8452", mec="black", label="flat ring, measured")
    ax.plot(b.sizes, [t * 1e3 for t in b.t("two_level")], "s", color="#4C72B0", mec="black",
            label="two-level, measured")
    if all(m is not None for m in d.model):
        ax.plot(b.sizes, [m.flat_ring_s * 1e3 for m in d.model], color="#DD8452", label="flat ring, model")
        ax.plot(b.sizes, [m.total_s * 1e3 for m in d.model], color="#4C72B0", label="two-level, model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_xlabel("message size S (bytes, log)")
    ax.set_ylabel("time (ms, log)")
    ax.set_title(f"All-reduce over {b.hosts} hosts × {b.per_host} ranks", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    keys = ("reduce_scatter", "all_reduce", "all_gather")
    last = d.model[-1]
    xs = range(len(keys))
    ax2.bar([x - 0.2 for x in xs], [b.t(k)[-1] * 1e3 for k in keys], 0.4, color="#4C72B0", label="measured")
    if last is not None:
        ax2.bar([x + 0.2 for x in xs], [t * 1e3 for t in (last.intra_reduce_scatter_s, last.inter_all_reduce_s,
                                                          last.intra_all_gather_s)],
                0.4, color="#BBBBBB", label="model")
    ax2.set_xticks(list(xs), [PHASE_LABEL[k].replace(" of S/g", "") for k in keys], fontsize=7)
    ax2.set_ylabel("time (ms)")
    ax2.set_title(f"Two-level phases at S = {C.fmt_bytes(b.sizes[-1])}", fontsize=10)
    ax2.legend(fontsize=7)
    return fig


def show(cluster, sizes=None, iters: int = 3, hosts: int | None = None) -> HierBench:
    """``%dp bench hierarchical``: measure, then show the figure and tables (text outside a kernel)."""
    hb = bench(cluster, sizes, iters, hosts)
    C.show_static(data(hb), figure, html, text)
    return hb


def save(path: str, hb: HierBench) -> str:
    return C.save_figure(figure(data(hb)), path)
