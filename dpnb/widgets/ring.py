"""Ring all-reduce, step by step (``%dp ring``).

The distributed story (Patarasuk & Yuan 2009): each of N ranks splits its
S-byte buffer into N chunks.  **Reduce-scatter**, N−1 steps: in step s rank r
sends chunk (r − s − 1) mod N to rank r+1, which adds it to its own copy of
that chunk; after N−1 steps rank r holds chunk r summed over all ranks.
**All-gather**, N−1 steps: in step s rank r sends chunk (r − s) mod N (fully
reduced) to rank r+1, which overwrites its copy; afterwards every rank holds
every reduced chunk.  Every step every rank sends S/N bytes, so each rank
sends 2(N−1)/N · S in all — independent of N for large N
(:func:`dpnb.core.collective_bytes`).  This is exactly
``reduce_scatter_single`` (rank r gets chunk r) followed by
``all_gather_single``; on a live cluster :func:`run_live` runs both on
real tensors and checks the result equals ``all_reduce``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import matplotlib.colors as mcolors
from matplotlib.patches import Rectangle

from dpnb.core import ConfigError, collective_bytes

from dpnb.engine import entrypoints as ep
from . import _common as C

MAX_PANELS_ALL = 9  # draw every step up to this many panels (n ≤ 5), else a selection


@dataclass(frozen=True)
class RingStep:
    """The state *after* a step: ``holds[r][c]`` = ranks whose chunk c is summed into rank r's copy.

    ``sends``: (src, dst, chunk) transfers in this step (empty for the initial state).
    """

    phase: str  # "start", "reduce-scatter", "all-gather"
    index: int  # 1-based within the phase (0 for start)
    sends: tuple[tuple[int, int, int], ...]
    holds: tuple[tuple[frozenset, ...], ...]

    def counts(self) -> list[list[int]]:
        return [[len(x) for x in row] for row in self.holds]


@dataclass(frozen=True)
class LiveRing:
    world_size: int
    numel: int
    bytes: int
    inputs: tuple[tuple[float, ...], ...]
    shards: tuple[tuple[float, ...], ...]
    gathered: tuple[tuple[float, ...], ...]
    allreduce: tuple[tuple[float, ...], ...]
    equal: bool
    max_abs_diff: float
    shown_all: bool
    reduce_scatter_s: float
    all_gather_s: float
    all_reduce_s: float


@dataclass(frozen=True)
class RingView:
    n: int
    size_bytes: float
    steps: tuple[RingStep, ...]
    chunk_bytes: float
    bytes_per_rank: float
    live: LiveRing | None = None


def ring_steps(n: int) -> list[RingStep]:
    """Initial state, N−1 reduce-scatter steps, N−1 all-gather steps."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ConfigError(f"a ring needs n ≥ 2 ranks, got {n!r}")
    holds = [[frozenset({r}) for _c in range(n)] for r in range(n)]
    out = [RingStep("start", 0, (), tuple(tuple(row) for row in holds))]
    for s in range(n - 1):
        sends = tuple((r, (r + 1) % n, (r - s - 1) % n) for r in range(n))
        new = [list(row) for row in holds]
        for src, dst, c in sends:
            new[dst][c] = holds[dst][c] | holds[src][c]
        holds = new
        out.append(RingStep("reduce-scatter", s + 1, sends, tuple(tuple(row) for row in holds)))
    for s in range(n - 1):
        sends = tuple((r, (r + 1) % n, (r - s) % n) for r in range(n))
        new = [list(row) for row in holds]
        for src, dst, c in sends:
            new[dst][c] = holds[src][c]
        holds = new
        out.append(RingStep("all-gather", s + 1, sends, tuple(tuple(row) for row in holds)))
    return out


def live_from_ranks(per_rank: list[dict]) -> LiveRing:
    rs = sorted(per_rank, key=lambda r: r["rank"])
    r0 = rs[0]
    return LiveRing(r0["world_size"], r0["numel"], r0["bytes"],
                    tuple(tuple(r["input"]) for r in rs), tuple(tuple(r["shard"]) for r in rs),
                    tuple(tuple(r["gathered"]) for r in rs), tuple(tuple(r["allreduce"]) for r in rs),
                    all(r["equal"] for r in rs), max(r["max_abs_diff"] for r in rs), bool(r0["shown_all"]),
                    max(r["reduce_scatter_s"] for r in rs), max(r["all_gather_s"] for r in rs),
                    max(r["all_reduce_s"] for r in rs))


def run_live(cluster, numel: int | None = None, seed: int = 0) -> LiveRing:
    """Run ``dpnb.engine.metrics.views.ring_demo`` on every rank (collective) and collect the result."""
    return live_from_ranks(C.call_ok(cluster, ep.RING_DEMO, numel, seed))


def data(n: int = 4, size_bytes: float = 1e6, live: LiveRing | None = None) -> RingView:
    """The ring schedule for ``n`` ranks and an S = ``size_bytes`` buffer (``live`` sets n)."""
    if live is not None:
        n = live.world_size
    if not size_bytes > 0:
        raise ConfigError(f"size must be > 0 bytes, got {size_bytes!r}")
    steps = ring_steps(int(n))
    return RingView(int(n), float(size_bytes), tuple(steps), size_bytes / n,
                    collective_bytes("all_reduce", size_bytes, int(n)), live)


# ----------------------------------------------------------------- output
def _step_title(st: RingStep, n: int) -> str:
    if st.phase == "start":
        return "start: rank r holds its own x_r"
    tag = "RS" if st.phase == "reduce-scatter" else "AG"
    return f"{tag} step {st.index}/{n - 1}"


def step_rows(d: RingView) -> list[list[str]]:
    rows = []
    sent = 0.0
    for st in d.steps[1:]:
        sent += d.chunk_bytes
        what = "adds" if st.phase == "reduce-scatter" else "copies"
        if d.n <= 4:
            moves = ", ".join(f"{a}→{b}: chunk {c}" for a, b, c in st.sends)
        else:
            back = st.index if st.phase == "reduce-scatter" else st.index - 1
            moves = f"r→r+1: chunk {'r' if back == 0 else f'(r−{back}) mod {d.n}'}"
        rows.append([st.phase, str(st.index), moves, what, C.fmt_bytes(d.chunk_bytes), C.fmt_bytes(sent)])
    return rows


HEADERS = ("phase", "step", "each rank sends (src→dst: chunk)", "receiver", "bytes sent per rank", "cumulative")


def _summary(d: RingView) -> list[str]:
    n = d.n
    lines = [f"N = {n} ranks, S = {C.fmt_bytes(d.size_bytes)}: {n} chunks of S/N = {C.fmt_bytes(d.chunk_bytes)}; "
             f"{n - 1} reduce-scatter + {n - 1} all-gather steps; each rank sends 2(N−1)/N·S = "
             f"{C.fmt_bytes(d.bytes_per_rank)} (and receives as much)"]
    if d.live:
        lv = d.live
        lines.append(f"live on {lv.world_size} ranks, {lv.numel} float32 ({C.fmt_bytes(lv.bytes)}): "
                     f"reduce_scatter_single + all_gather_single "
                     f"{'==' if lv.equal else '!='} all_reduce (max |diff| {lv.max_abs_diff:g}); "
                     f"RS {C.fmt_ms(lv.reduce_scatter_s)} + AG {C.fmt_ms(lv.all_gather_s)} vs "
                     f"all_reduce {C.fmt_ms(lv.all_reduce_s)}")
    return lines


def _live_rows(lv: LiveRing) -> list[list[str]]:
    def f(xs):
        return "[" + ", ".join(f"{x:g}" for x in xs) + ("]" if lv.shown_all else ", …]")

    return [[f"rank {r}", f(lv.inputs[r]), f(lv.shards[r]), f(lv.gathered[r]), f(lv.allreduce[r])]
            for r in range(lv.world_size)]


LIVE_HEADERS = ("rank", "input x_r", "after reduce_scatter (chunk r)", "after all_gather", "all_reduce(x)")


def text(d: RingView) -> str:
    out = ["Ring all-reduce = reduce-scatter + all-gather"] + ["  " + s for s in _summary(d)]
    out += ["", C.text_table(HEADERS, step_rows(d))]
    if d.live:
        out += ["", C.text_table(LIVE_HEADERS, _live_rows(d.live))]
    return "\n".join(out)


def html(d: RingView) -> str:
    out = C.html_lines(_summary(d)) + C.html_table(HEADERS, step_rows(d), "Steps")
    if d.live:
        out += C.html_table(LIVE_HEADERS, _live_rows(d.live), "Live tensors (float32, integer-valued so sums are exact)")
    return out


def _panel(ax, st: RingStep, n: int, chunk_bytes: float) -> None:
    """One step as an N×N grid: rows = ranks, columns = chunks, shade = how many
    ranks' contributions the copy holds; sent chunks outlined, received ones marked."""

    cmap = mcolors.LinearSegmentedColormap.from_list("ring", ["#f2f2f2", "#4C72B0"])
    counts = st.counts()
    sent = {(a, c) for a, _b, c in st.sends}
    recv = {(b, c) for _a, b, c in st.sends}
    for r in range(n):
        for c in range(n):
            k = counts[r][c]
            rect = Rectangle((c, r), 1, 1, facecolor=cmap((k - 1) / max(1, n - 1)),
                             edgecolor="black" if (r, c) in sent else "white", lw=2.2 if (r, c) in sent else 1)
            rect._dpnb_ring = (r, c, k)
            ax.add_patch(rect)
            if n <= 6:
                ax.text(c + 0.5, r + 0.5, f"{k}/{n}", ha="center", va="center", fontsize=8 if n <= 4 else 6.5,
                        color="white" if k > n / 2 else "black")
            if (r, c) in recv:
                ax.plot(c + 0.85, r + 0.18, marker="v", color="#D62728", ms=5)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(n)])
    ax.set_xticklabels([str(c) for c in range(n)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(n)])
    ax.set_yticklabels([str(r) for r in range(n)], fontsize=7)
    ax.tick_params(length=0)
    sent_txt = "" if st.phase == "start" else f"\nsends {C.fmt_bytes(chunk_bytes)}/rank"
    ax.set_title(_step_title(st, n) + sent_txt, fontsize=8.5)


def _selected(d: RingView) -> list[RingStep]:
    if len(d.steps) <= MAX_PANELS_ALL:
        return list(d.steps)
    n = d.n
    pick = [0, 1, n - 1, n, 2 * (n - 1)]
    return [d.steps[i] for i in sorted(set(pick))]


def figure(d: RingView, step: int | None = None):
    """Small multiples of the steps (all of them for n ≤ 5, else start, first
    and last of each phase); rows = ranks, columns = chunks, shade = number of
    ranks summed in; black outline = chunk sent this step, red ▼ = received.
    ``step`` (0 … 2(n−1)) draws that one step alone, larger."""
    steps = [d.steps[step]] if step is not None else _selected(d)
    k = len(steps)
    extra = 1 if d.live else 0
    ncols = min(k + extra, 5 if step is None else 2)
    nrows = math.ceil((k + extra) / ncols)
    cell = 1.85 if step is None else 4.0
    fig = C.new_figure(cell * nrows + 1.3)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = [a for row in axes for a in row]
    for ax, st in zip(flat, steps):
        _panel(ax, st, d.n, d.chunk_bytes)
    for i, ax in enumerate(flat):
        if i % ncols == 0 and i < len(steps):
            ax.set_ylabel("rank", fontsize=8)
        if i < len(steps) and i >= len(flat) - ncols:
            ax.set_xlabel("chunk", fontsize=8)
    if d.live:
        ax = flat[k]
        lv = d.live
        names = ["reduce-\nscatter", "all-\ngather", "RS + AG", "all_reduce"]
        vals = [lv.reduce_scatter_s, lv.all_gather_s, lv.reduce_scatter_s + lv.all_gather_s, lv.all_reduce_s]
        ax.bar(range(4), [v * 1e3 for v in vals], color=[C.COLORS["reduce_scatter"], C.COLORS["all_gather"],
                                                        "#8172B3", C.COLORS["all_reduce"]])
        ax.set_xticks(range(4))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("time (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title(f"live, {lv.world_size} ranks: RS+AG {'==' if lv.equal else '≠'} all_reduce", fontsize=8.5,
                     color="#2a7d2a" if lv.equal else "#b00020")
    for ax in flat[k + extra:]:
        ax.axis("off")
    skipped = "" if len(steps) == len(d.steps) or step is not None else " (first and last step of each phase shown)"
    fig.suptitle(f"Ring all-reduce on N = {d.n} ranks, S = {C.fmt_bytes(d.size_bytes)}: reduce-scatter (RS), then "
                 f"all-gather (AG)\neach rank sends 2(N−1)/N·S = {C.fmt_bytes(d.bytes_per_rank)} in total{skipped}\n"
                 "cells: rank (row) × chunk (column), k/N = ranks summed into that copy; black outline = sent, "
                 "red ▼ = received", fontsize=8.5)
    return fig


def view(cluster=None, *, n: int = 4, size_bytes: float = 1e6, numel: int | None = None, live: LiveRing | None = None):
    """The ring widget: N, S and a step slider (−1: all steps); with ``cluster``
    the live reduce-scatter + all-gather check runs first (collective)."""
    if cluster is not None and live is None:
        live = run_live(cluster, numel)
    if live is not None:
        n = live.world_size
    controls = {
        "n": C.int_slider("ranks N", n, 2, 16),
        "size_bytes": C.log_slider("S (bytes)", size_bytes, 3, 10, 0.1),
        "step": C.int_slider("step (−1: all)", -1, -1, 30),
    }
    if live is not None:
        controls["n"].disabled = True

    def compute(v: dict) -> RingView:
        return data(v["n"], v["size_bytes"], live)

    def fig(d: RingView):
        s = box_ref[0].controls["step"].value if box_ref else -1
        return figure(d, None if s < 0 or s > 2 * (d.n - 1) else s)

    box_ref: list = []
    box = C.viewbox("Ring all-reduce, step by step" + (" (live)" if live else ""), controls, compute, fig, html, text)
    box_ref.append(box)
    box.refresh()
    return box


def show(cluster=None, **kw: Any) -> None:
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        live = run_live(cluster, kw.get("numel")) if cluster is not None else kw.get("live")
        print(text(data(kw.get("n", 4), kw.get("size_bytes", 1e6), live)))


def save(path: str, cluster=None, **kw: Any) -> str:
    live = run_live(cluster, kw.get("numel")) if cluster is not None else kw.get("live")
    return C.save_figure(figure(data(kw.get("n", 4), kw.get("size_bytes", 1e6), live), kw.get("step")), path)
