"""Stragglers (``%dp straggle --rank R --delay MS`` and ``%dp stragglers``).

The distributed story: synchronous data parallelism waits for every rank in
the gradient all-reduce, so a step takes as long as its *slowest* rank
(:func:`dpnb.core.step_time`).  If each of N ranks is independently slow
with probability p in a step, some rank is slow with probability
1 − (1 − p)^N (:func:`dpnb.core.straggler_probability`), which tends to 1 as
N grows: at scale, rare hiccups become the common case.

:func:`inject` makes one rank sleep in each training step (the engine's
``EngineState.straggle_delay_s``, read by the training loop); the view then
shows, from the step records, each rank's compute time next to the step time
that everyone pays.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as w
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from dpnb.core import (
    ConfigError,
    StragglerEstimate,
    straggler_estimate,
    straggler_probability,
)

from dpnb.engine import entrypoints as ep
from . import _common as C

MAX_STEPS_DRAWN = 10
CURVE_PS = (0.001, 0.01, 0.05)


@dataclass(frozen=True)
class StepRow:
    """One step: each rank's compute time (s), the step time (s), the slowest rank."""

    step: int
    compute_s: tuple[float, ...]
    step_s: float
    slowest: int

    @property
    def wait_s(self) -> tuple[float, ...]:
        """How long each rank waited for the slowest one (compute gap)."""
        m = max(self.compute_s)
        return tuple(m - c for c in self.compute_s)


@dataclass(frozen=True)
class StragglerView:
    steps: tuple[StepRow, ...]
    world_size: int
    delays_s: tuple[float, ...]  # injected delay per rank (0 where none / unknown)
    p: float
    n: int
    delay_s: float
    estimate: StragglerEstimate
    curve_ns: tuple[int, ...]
    curves: dict = field(default_factory=dict)  # p -> probabilities over curve_ns


def steps_from_records(records: list[dict]) -> list[StepRow]:
    """StepRows from step records (one rank's records carry every rank's compute in ``compute_s_all``)."""
    seen: dict[int, StepRow] = {}
    for r in sorted(records, key=lambda r: r["step"]):
        comp = r.get("compute_s_all")
        if not comp:
            continue
        comp = tuple(float(c) for c in comp)
        slow = max(range(len(comp)), key=lambda i: comp[i])
        seen[r["step"]] = StepRow(int(r["step"]), comp, float(r["step_time_s"]), slow)
    return list(seen.values())


def data(records: list[dict] | None = None, *, p: float = 0.01, n: int | None = None, delay_ms: float | None = None,
         delays_s: list[float] | None = None, max_n: int = 4096, last: int = MAX_STEPS_DRAWN) -> StragglerView:
    """The straggler view from step records (may be empty) and the probability model.

    ``n`` defaults to the records' world size (or 8); ``delay_ms`` to the
    largest injected delay (or the measured gap between the slowest and the
    median rank).  The estimate is E[step] = base + delay × (1 − (1 − p)^N)
    with ``base`` the median step time of ranks without delay.
    """
    if not 0 < p < 1:
        raise ConfigError(f"p must be a probability strictly between 0 and 1, got {p!r}")
    rows = steps_from_records(records or [])[-int(last):] if last else steps_from_records(records or [])
    ws = len(rows[0].compute_s) if rows else int(n or 8)
    n = int(n or ws)
    if n < 1:
        raise ConfigError(f"n must be ≥ 1, got {n}")
    delays = tuple(float(x) for x in (delays_s or [0.0] * ws))
    if delay_ms is None:
        if any(delays):
            delay_s = max(delays)
        elif rows:
            # how much later than the median of the *other* ranks the slowest
            # one finishes (with 2 ranks: slowest minus the other)
            gaps = sorted(max(r.compute_s) - statistics.median(sorted(r.compute_s)[:-1] or [0.0])
                          for r in rows)
            delay_s = statistics.median(gaps)
        else:
            delay_s = 0.1
    else:
        delay_s = float(delay_ms) / 1e3
    if rows:
        base = sorted(r.step_s - max(delays) if any(delays) else r.step_s for r in rows)[len(rows) // 2]
        base = max(base, 1e-6)
    else:
        base = 0.2
    est = straggler_estimate(base, n, p, delay_s)
    ns = []
    k = 1
    while k <= max_n:
        ns.append(k)
        k *= 2
    curves = {pp: tuple(straggler_probability(pp, m) for m in ns) for pp in sorted(set(CURVE_PS) | {p})}
    return StragglerView(tuple(rows), ws, delays, float(p), n, delay_s, est, tuple(ns), curves)


def fetch(cluster, last: int = 50) -> tuple[list[dict], list[float]]:
    """Rank 0's last step records and every rank's injected delay (no collective)."""
    recs = C.call_ok(cluster, ep.RECORDS, None, last, ranks=[0])[0]
    delays = [s["delay_s"] for s in C.call_ok(cluster, ep.STRAGGLE_STATE)]
    return recs, delays


def inject(cluster, rank: int, delay_ms: float) -> list[float]:
    """Make ``rank`` sleep ``delay_ms`` in every training step (0 clears); returns every rank's delay (s).

    ``%dp straggle --rank R --delay MS``.  Only that rank's engine is told
    (no communication); the next ``%dp train`` shows the others waiting for it.
    """
    if not 0 <= int(rank) < cluster.world_size:
        raise C.ViewError(f"--rank {rank} out of range: the cluster has ranks 0-{cluster.world_size - 1}")
    C.call_ok(cluster, ep.SET_STRAGGLE, float(delay_ms), ranks=[int(rank)])
    return [s["delay_s"] for s in C.call_ok(cluster, ep.STRAGGLE_STATE)]


def clear(cluster) -> None:
    """Remove every injected delay (``%dp straggle --clear``)."""
    C.call_ok(cluster, ep.SET_STRAGGLE, 0.0)


# ----------------------------------------------------------------- output
#: up to this many ranks each gets its own bar (and column) per step; beyond,
#: the spread over ranks is drawn with the slowest rank named
BARS_UP_TO = 8


def table_rows(d: StragglerView) -> list[list[str]]:
    if d.world_size > BARS_UP_TO:  # one column per rank stops being readable: the spread
        return [[str(r.step), C.fmt_ms(min(r.compute_s)), C.fmt_ms(statistics.median(r.compute_s)),
                 C.fmt_ms(max(r.compute_s)), C.fmt_ms(r.step_s), f"rank {r.slowest}"] for r in d.steps]
    return [[str(r.step)] + [C.fmt_ms(c) for c in r.compute_s] + [C.fmt_ms(r.step_s), f"rank {r.slowest}"]
            for r in d.steps]


def _headers(d: StragglerView) -> list[str]:
    if d.world_size > BARS_UP_TO:
        return ["step", "compute min", "median", "max", "step time", "slowest"]
    return ["step"] + [f"rank {i} compute" for i in range(d.world_size)] + ["step time", "slowest"]


def _summary(d: StragglerView) -> list[str]:
    e = d.estimate
    lines = []
    if any(d.delays_s):
        lines.append("injected delay: " + ", ".join(f"rank {i} {C.fmt_ms(x)}" for i, x in enumerate(d.delays_s) if x))
    if d.steps:
        slow = {}
        for r in d.steps:
            slow[r.slowest] = slow.get(r.slowest, 0) + 1
        top = max(slow, key=lambda k: slow[k])
        lines.append(f"last {len(d.steps)} steps: rank {top} was the slowest in {slow[top]} of them; every step "
                     f"takes the slowest rank's time (the others wait in the gradient all-reduce)")
    lines.append(f"if each rank is late by {C.fmt_ms(d.delay_s)} with probability p = {d.p:g}: "
                 f"P(some rank of {d.n} is late) = 1 − (1 − p)^N = {e.probability:.3g}, expected step "
                 f"{C.fmt_ms(e.expected_step_s)} vs {C.fmt_ms(e.base_s)} (efficiency {e.efficiency:.1%})")
    return lines


def text(d: StragglerView) -> str:
    out = ["Stragglers"] + ["  " + s for s in _summary(d)]
    if d.steps:
        out += ["", C.text_table(_headers(d), table_rows(d))]
    return "\n".join(out)


def html(d: StragglerView) -> str:
    out = C.html_lines(_summary(d))
    if d.steps:
        out += C.html_table(_headers(d), table_rows(d), "Per-step compute time per rank (the step waits for the slowest)")
    return out


def _spread_panel(ax, d: StragglerView) -> None:
    """Many ranks: per step the range of compute times over all ranks, the
    median, the slowest rank (named) and the step time everyone waited for."""

    for i, r in enumerate(d.steps):
        cs = [c * 1e3 for c in r.compute_s]
        lo, hi = min(cs), max(cs)
        ax.bar(i, hi - lo, 0.5, bottom=lo, color="#A7BBDD", edgecolor="none")
        ax.plot([i - 0.25, i + 0.25], [statistics.median(cs)] * 2, color="#4C72B0", lw=2)
        ax.plot([i], [cs[r.slowest]], "o", color="#b00020", ms=5)
        ax.annotate(f"rank {r.slowest}", (i, r.step_s * 1e3), textcoords="offset points", xytext=(0, 4),
                    fontsize=7, ha="center", va="bottom", color="#b00020")
        ax.plot([i - 0.45, i + 0.45], [r.step_s * 1e3] * 2, color="black", lw=2)
    ax.set_xticks(range(len(d.steps)))
    ax.set_xticklabels([str(r.step) for r in d.steps], fontsize=8)
    top = max(max(max(r.compute_s), r.step_s) for r in d.steps) * 1e3
    ax.set_ylim(0, top * 1.35)
    handles = [Patch(color="#A7BBDD", label=f"compute, min-max over {d.world_size} ranks"),
               Line2D([], [], color="#4C72B0", lw=2, label="median rank"),
               Line2D([], [], marker="o", color="#b00020", lw=0, label="slowest rank"),
               Line2D([], [], color="black", lw=2, label="step time (all ranks)")]
    ax.legend(handles=handles, fontsize=7.5, ncol=2, loc="upper left")
    ax.set_title("Each step waits for the slowest rank (named)", fontsize=10)


def figure(d: StragglerView):
    """Left: per step, each rank's compute time (bars) and the step time (black
    line), slowest rank outlined; right: 1 − (1 − p)^N vs N."""
    fig = C.new_figure(4.2)
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.3, 1])
    if d.steps and d.world_size > BARS_UP_TO:
        _spread_panel(ax, d)
    elif d.steps:
        ws = d.world_size
        width = 0.8 / ws
        cmap = ["#4C72B0", "#55A868", "#8172B3", "#64B5CD", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974"]
        for i, r in enumerate(d.steps):
            for k, c in enumerate(r.compute_s):
                x = i - 0.4 + width * (k + 0.5)
                ax.bar(x, c * 1e3, width * 0.95, color=cmap[k % len(cmap)],
                       edgecolor="#b00020" if k == r.slowest else "none", linewidth=1.8 if k == r.slowest else 0)
            ax.plot([i - 0.45, i + 0.45], [r.step_s * 1e3] * 2, color="black", lw=2)
        ax.set_xticks(range(len(d.steps)))
        ax.set_xticklabels([str(r.step) for r in d.steps], fontsize=8)
        top = max(max(max(r.compute_s), r.step_s) for r in d.steps) * 1e3
        ax.set_ylim(0, top * 1.3)

        handles = [Patch(color=cmap[k % len(cmap)], label=f"rank {k} compute") for k in range(ws)]
        handles += [Line2D([], [], color="black", lw=2, label="step time (all ranks)"),
                    Patch(facecolor="none", edgecolor="#b00020", lw=1.8, label="slowest rank")]
        ax.legend(handles=handles, fontsize=7.5, ncol=2 if ws <= 4 else 3, loc="upper left")
        ax.set_title("Each step waits for the slowest rank (red outline)", fontsize=10)
    else:
        ax.text(0.5, 0.5, "no step records yet:\nrun %dp train, then look again", ha="center", va="center",
                transform=ax.transAxes, fontsize=10)
        ax.set_title("Per-rank compute time per step", fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("time (ms)")
    ax.grid(True, axis="y", alpha=0.3)

    for pp, ys in d.curves.items():
        ax2.plot(d.curve_ns, ys, "-" if pp == d.p else ":", lw=2 if pp == d.p else 1.2, label=f"p = {pp:g}")
    ax2.plot([d.n], [d.estimate.probability], "o", color="black", ms=6)
    ax2.annotate(f"N={d.n}: P = {d.estimate.probability:.2g}", (d.n, d.estimate.probability),
                 textcoords="offset points", xytext=(-10, 22), fontsize=8, ha="center",
                 bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="gray", lw=0.5),
                 arrowprops=dict(arrowstyle="-", color="gray", lw=0.8))
    ax2.set_xscale("log", base=2)

    ax2.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("number of ranks N (log₂)")
    ax2.set_ylabel("P(at least one rank is late)")
    ax2.set_title("1 − (1 − p)^N: some rank is almost always late", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(True, alpha=0.3)
    ax2.minorticks_off()
    return fig


def view(cluster=None, *, records: list[dict] | None = None, p: float = 0.01, n: int | None = None,
         delay_ms: float | None = None, last: int = MAX_STEPS_DRAWN):
    """The straggler widget.  With ``cluster``: the last steps' records, an
    inject control (rank, delay, button) and a refresh button."""

    state = {"records": records or [], "delays": None}
    if cluster is not None:
        state["records"], state["delays"] = fetch(cluster)
    d0 = data(state["records"], p=p, n=n, delay_ms=delay_ms, delays_s=state["delays"], last=last)
    controls = {
        "p": C.log_slider("p (late/step)", p, -4, -0.31, 0.05),
        "n": C.int_slider("N ranks", d0.n, 1, 4096),
        "delay_ms": C.float_slider("delay (ms)", d0.delay_s * 1e3, 0, 5000, 1, fmt=".4g"),
    }
    extra = []
    if cluster is not None:
        rank = w.Dropdown(options=list(range(cluster.world_size)), value=0, description="rank",
                          layout=w.Layout(width="160px"))
        dly = w.FloatText(value=100.0, description="delay ms", layout=w.Layout(width="180px"))
        btn = w.Button(description="inject", tooltip="%dp straggle --rank R --delay MS")
        clr = w.Button(description="clear all")
        ref = w.Button(description="refresh records")
        extra.append(w.HBox([rank, dly, btn, clr, ref]))

    def compute(v: dict) -> StragglerView:
        return data(state["records"], p=v["p"], n=v["n"], delay_ms=v["delay_ms"], delays_s=state["delays"],
                    last=last)

    box = C.viewbox("Stragglers" + (" (live)" if cluster is not None else ""), controls, compute, figure, html, text,
                    extra=extra)
    if cluster is not None:
        def do_inject(_b):
            state["delays"] = inject(cluster, rank.value, dly.value)
            box.refresh()

        def do_clear(_b):
            clear(cluster)
            state["delays"] = [0.0] * cluster.world_size
            box.refresh()

        def do_refresh(_b):
            state["records"], state["delays"] = fetch(cluster)
            box.refresh()

        btn.on_click(do_inject)
        clr.on_click(do_clear)
        ref.on_click(do_refresh)
    return box


def show(cluster=None, **kw: Any) -> None:
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        recs, delays = fetch(cluster) if cluster is not None else (kw.pop("records", None), None)
        kw.pop("records", None)
        print(text(data(recs, delays_s=delays, **kw)))


def save(path: str, cluster=None, **kw: Any) -> str:
    recs, delays = fetch(cluster) if cluster is not None else (kw.pop("records", None), None)
    kw.pop("records", None)
    return C.save_figure(figure(data(recs, delays_s=delays, **kw)), path)
