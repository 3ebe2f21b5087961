"""ZeRO memory (``%dp memory``): per-rank model-state bytes for stages 0–3, and measured vs exact.

The distributed story: plain DDP (stage 0) keeps parameters, gradients and
optimizer state whole on every rank; ZeRO-1 shards the optimizer state
(master weights + moments) over the N data-parallel ranks, ZeRO-2 also the
gradients (reduce-scatter instead of all-reduce), ZeRO-3 also the parameters
(all-gathered per layer for forward and backward).  The analytic bars come
from :func:`dpnb.core.memory_table` (Rajbhandari et al. 2020), the "fits?"
readout from :func:`dpnb.core.max_params_that_fit` / :func:`min_dp_to_fit`.

With a live cluster each rank reports the bytes it really holds right after
``optimizer.step()`` (counted from the tensors by the training layer) next to
:func:`dpnb.core.exact_rank_bytes` for the wrapped model and strategy (DDP,
``ZeroRedundancyOptimizer``, FSDP2), byte for byte; the difference is shown in
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ipywidgets as w

from dpnb.core import (
    GB,
    ConfigError,
    max_params_that_fit,
    memory_table,
    min_dp_to_fit,
)
from dpnb.core.labviews import MEMORY_PARTS as LIVE_PARTS, memory_panel
from dpnb.core.memory import MODELED_OPTIMIZERS as OPTIMIZERS, OFFLOADS, PRECISIONS

from dpnb.engine import entrypoints as ep
from ..ranks import rank_label
from . import _common as C

PART_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "grad_accum": "fp32 grad accumulation",
    "master_weights": "master weights (fp32)",
    "optimizer_moments": "optimizer moments",
}
LIVE_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
LIVE_COLORS = {"params": C.COLORS["params"], "grads": C.COLORS["grads"], "optimizer": C.COLORS["optimizer"]}
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
PRECISION_OF = {"none": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


@dataclass(frozen=True)
class StageBar:
    """One analytic bar: per-rank device bytes of each part under ZeRO ``stage``."""

    stage: int
    parts: dict
    total: float
    fits: bool
    max_params: int
    min_dp: int | None
    min_dp_note: str = ""


@dataclass(frozen=True)
class RankMemory:
    """Measured vs exact bytes on one rank (parts: params, grads, optimizer)."""

    rank: int
    measured: dict
    predicted: dict
    diff: dict  # measured - predicted, per part and "total"

    @property
    def agrees(self) -> bool:
        return all(v == 0 for v in self.diff.values())


@dataclass(frozen=True)
class LiveMemory:
    strategy: str
    optimizer: str
    world_size: int
    phase: str
    step: int | None
    n_params: int
    ranks: tuple[RankMemory, ...]
    precision: str = "fp32"  # the wrapped model's, as the memory view's menu names it

    @property
    def agrees(self) -> bool:
        return all(r.agrees for r in self.ranks)


@dataclass(frozen=True)
class MemoryView:
    n_params: float
    dp: int
    precision: str
    optimizer: str
    capacity_bytes: float
    fp32_grad_accum: bool
    offload: str
    bars: tuple[StageBar, ...]
    highlight_stage: int | None
    live: LiveMemory | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    stages: bool = True  # the ZeRO stage bars; False: the live model alone (before ZeRO is taught)


def data(n_params: float = 7e9, dp: int = 8, precision: str = "bf16-mixed", optimizer: str = "adam",
         capacity_gb: float = 80.0, *, fp32_grad_accum: bool = False, offload: str = "none",
         strategy: str | None = None, live: LiveMemory | None = None, stages: bool = True) -> MemoryView:
    """Analytic per-rank bars for stages 0–3 (decimal GB capacity), plus optional live data."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if offload not in OFFLOADS:
        raise ConfigError(f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if not capacity_gb > 0:
        raise ConfigError(f"device capacity must be > 0 GB, got {capacity_gb!r}")
    cap = float(capacity_gb) * GB
    rows = memory_table(float(n_params), int(dp), precision, optimizer,  # type: ignore[arg-type]
                        fp32_grad_accum=fp32_grad_accum, offload=offload)  # type: ignore[arg-type]
    bars = []
    for row in rows:
        off = row.offload
        mx = max_params_that_fit(cap, int(dp), row.stage, precision, optimizer,  # type: ignore[arg-type]
                                 fp32_grad_accum=fp32_grad_accum, offload=off)  # type: ignore[arg-type]
        try:
            mdp: int | None = min_dp_to_fit(float(n_params), cap, row.stage, precision, optimizer,  # type: ignore[arg-type]
                                            fp32_grad_accum=fp32_grad_accum, offload=off)  # type: ignore[arg-type]
            note = ""
        except ConfigError as e:
            mdp, note = None, str(e)
        bars.append(StageBar(row.stage, row.parts(), row.total, row.fits(cap), mx, mdp, note))
    hl = STAGE_OF.get(strategy) if strategy else (STAGE_OF.get(live.strategy) if live else None)
    return MemoryView(float(n_params), int(dp), precision, optimizer, cap, fp32_grad_accum, offload,
                      tuple(bars), hl, live, stages=stages or live is None)


def live_data(snapshots: list[dict]) -> LiveMemory:
    """Measured vs :func:`dpnb.core.exact_rank_bytes` from each rank's
    :func:`dpnb.engine.metrics.views.memory_snapshot` (a list in rank order).

    The comparison is part by part: parameter storage (FSDP2: the padded
    shard), gradient storage (DDP's ``gradient_as_bucket_view`` buckets;
    FSDP2's padded reduce-scatter output), optimizer state (moments + Adam's
    ``step`` scalars).  If the snapshot was taken between steps (no recorded
    step), gradients have been freed and the prediction uses 0 for them.
    """
    if not snapshots:
        raise C.ViewError("no memory snapshots: is a model wrapped? run %dp wrap and %dp train --steps 1")
    ws = snapshots[0]["world_size"]
    if len(snapshots) != ws:
        raise C.ViewError(f"need one snapshot per rank ({ws}), got {len(snapshots)}")
    mp = memory_panel(snapshots)
    ranks = []
    for r in mp.ranks:
        measured = dict(zip(LIVE_PARTS, r.measured))
        predicted = dict(zip(LIVE_PARTS, r.predicted))
        diff = {k: measured[k] - predicted[k] for k in LIVE_PARTS}
        diff["total"] = sum(diff.values())
        ranks.append(RankMemory(r.rank, measured, predicted, diff))
    return LiveMemory(mp.strategy, mp.optimizer, ws, mp.phase, mp.step, mp.n_params, tuple(ranks),
                      PRECISION_OF.get(mp.mixed_precision, "fp32"))


def fetch(cluster) -> LiveMemory:
    """Ask every rank for its snapshot and compare with the exact model (no collective)."""
    snaps = C.call_ok(cluster, ep.MEMORY_SNAPSHOT)
    return live_data(snaps)


# ----------------------------------------------------------------- output
def fits_rows(d: MemoryView) -> list[list[str]]:
    rows = []
    for b in d.bars:
        rows.append([f"ZeRO-{b.stage}" + (" (DDP)" if b.stage == 0 else ""),
                     C.fmt_bytes(b.total),
                     "yes" if b.fits else "NO",
                     C.fmt_count(b.max_params),
                     str(b.min_dp) if b.min_dp is not None else "never"])
    return rows


FITS_HEADERS = ("stage", "per rank", "fits?", "largest model that fits", "min DP for this model")


def live_rows(lm: LiveMemory) -> list[list[str]]:
    rows = []
    for label, r in bar_groups(lm):
        for k in LIVE_PARTS:
            rows.append([label, LIVE_LABELS[k], f"{r.predicted[k]:,}", f"{r.measured[k]:,}",
                         C.fmt_signed_bytes(r.diff[k])])
        rows.append([label, "total", f"{sum(r.predicted.values()):,}",
                     f"{sum(r.measured.values()):,}", C.fmt_signed_bytes(r.diff["total"])])
    return rows


LIVE_HEADERS = ("rank", "part", "predicted (B)", "measured (B)", "measured − predicted")


def _summary(d: MemoryView) -> list[str]:
    lines = [f"{C.fmt_count(d.n_params)} parameters, DP={d.dp}, {d.precision}, {d.optimizer}, "
             f"device {d.capacity_bytes / GB:g} GB (decimal, 1 GB = 10⁹ B); model states only "
             "(activations, buffers, fragmentation not counted)"]
    fit = [b for b in d.bars if b.fits]
    if d.stages:
        lines.append("fits: " + (", ".join(f"ZeRO-{b.stage}" for b in fit) if fit else "no stage fits")
                     + " | largest model per stage: "
                     + ", ".join(f"ZeRO-{b.stage} {C.fmt_count(b.max_params)}" for b in d.bars))
    if d.live:
        lm = d.live
        when = "after optimizer.step() of step %s" % lm.step if lm.phase == "after_step" else "now, between steps (grads freed)"
        verdict = ("measured == predicted on every rank, byte for byte" if lm.agrees
                   else "measured and predicted DIFFER: " + "; ".join(
                       f"{label} {C.fmt_signed_bytes(r.diff['total'])}" for label, r in bar_groups(lm)
                       if not r.agrees))
        lines.append(f"live: {lm.strategy}, {lm.optimizer}, {lm.world_size} ranks, {C.fmt_count(lm.n_params)} params, "
                     f"measured {when}: {verdict}")
    return lines


def text(d: MemoryView) -> str:
    out = [("ZeRO memory" if d.stages else "Memory") + " per rank"] + ["  " + s for s in _summary(d)]
    if d.stages:
        out += ["", C.text_table(FITS_HEADERS, fits_rows(d))]
    if d.live:
        out += ["", C.text_table(LIVE_HEADERS, live_rows(d.live))]
    return "\n".join(out)


def html(d: MemoryView) -> str:
    out = C.html_lines(_summary(d))
    if d.stages:
        out += C.html_table(FITS_HEADERS, fits_rows(d), "Fits? (decimal GB)",
                            highlight=lambda i: d.highlight_stage == i)
    if d.live:
        out += C.html_table(LIVE_HEADERS, live_rows(d.live), "Measured vs exact prediction, per rank (bytes)")
    return out


def figure(d: MemoryView):
    """Stacked per-rank bars for stages 0–3 with the capacity line; with live
    data a second panel: exact prediction vs measured bars per rank."""
    fig = C.new_figure(4.6)
    if d.live and not d.stages:
        _live_panel(fig.subplots(1, 1), d.live)
        return fig
    if d.live:
        ax, ax2 = fig.subplots(1, 2, width_ratios=[1.15, 1])
    else:
        ax, ax2 = fig.subplots(1, 1), None
    biggest = max(b.total for b in d.bars)
    cap_on_scale = biggest >= 0.02 * d.capacity_bytes
    top = max(biggest, d.capacity_bytes) if cap_on_scale else biggest
    div, unit = (GB, "GB") if top >= 0.5 * GB else C.byte_scale(top)
    x = list(range(len(d.bars)))
    for part in PART_LABELS:
        if not any(b.parts[part] for b in d.bars):
            continue
        bottoms = [sum(b.parts[p] for p in list(PART_LABELS)[:list(PART_LABELS).index(part)]) / div for b in d.bars]
        ax.bar(x, [b.parts[part] / div for b in d.bars], 0.6, bottom=bottoms, color=C.COLORS[part],
               label=PART_LABELS[part], edgecolor="white", linewidth=0.5)
    for i, b in enumerate(d.bars):
        ax.text(i, b.total / div, f"{b.total / div:,.4g}", ha="center", va="bottom", fontsize=9)
    if cap_on_scale:
        ax.axhline(d.capacity_bytes / div, color="black", ls="--", lw=1.2,
                   label=f"device capacity {d.capacity_bytes / GB:g} GB")
    else:
        ax.text(0.01, 0.98, f"device capacity {d.capacity_bytes / GB:g} GB: far above this scale",
                transform=ax.transAxes, ha="left", va="top", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([f"ZeRO-{b.stage}" + (" (DDP)" if b.stage == 0 else "") + "\n"
                        + ("fits" if b.fits else "does not fit") for b in d.bars], fontsize=9)
    for lab, b in zip(ax.get_xticklabels(), d.bars):
        if not b.fits:
            lab.set_color("#b00020")
        if d.highlight_stage == b.stage:
            lab.set_fontweight("bold")
    ax.set_ylabel(f"bytes per rank ({C.unit_note(unit)})")
    ax.set_ylim(0, (top / div or 1) * 1.18)
    ax.set_title(f"Model states per rank: {C.fmt_count(d.n_params)} params, DP={d.dp}, "
                 f"{d.precision}, {d.optimizer}", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper right", framealpha=0.9)
    ax.grid(True, axis="y", alpha=0.3)
    if ax2 is not None and d.live:
        _live_panel(ax2, d.live)
    return fig


#: above this many ranks, ranks holding the same bytes share one pair of bars
GROUP_ABOVE = 8


def bar_groups(lm: LiveMemory) -> list[tuple[str, RankMemory]]:
    """``(label, representative)`` per pair of bars: one per rank up to
    :data:`GROUP_ABOVE` ranks; beyond, one per distinct (predicted,
    measured), labelled with its ranks (``ranks 0-30``), so 32 equal ranks
    make one pair and the rank that differs (FSDP's padded last shard, a
    leak) gets its own."""
    if len(lm.ranks) <= GROUP_ABOVE:
        return [(f"rank {r.rank}", r) for r in lm.ranks]
    groups: dict[tuple, list[RankMemory]] = {}
    for r in lm.ranks:
        key = (tuple(r.predicted[k] for k in LIVE_PARTS), tuple(r.measured[k] for k in LIVE_PARTS))
        groups.setdefault(key, []).append(r)
    return [(rank_label(r.rank for r in rs), rs[0]) for rs in groups.values()]


def _live_panel(ax, lm: LiveMemory) -> None:
    bars = bar_groups(lm)
    tops = [max(sum(r.predicted.values()), sum(r.measured.values())) for _, r in bars]
    div, unit = C.byte_scale(max(tops) if tops else 1)
    w = 0.38
    for i, (_, r) in enumerate(bars):
        for j, (src, vals) in enumerate((("predicted", r.predicted), ("measured", r.measured))):
            xpos = i + (j - 0.5) * (w + 0.04)
            bottom = 0.0
            for k in LIVE_PARTS:
                ax.bar(xpos, vals[k] / div, w, bottom=bottom, color=LIVE_COLORS[k],
                       hatch="//" if src == "measured" else None, edgecolor="white", linewidth=0.5,
                       label=(LIVE_LABELS[k] if (i == 0 and j == 0) else None))
                bottom += vals[k] / div
            tag = ("exact" if src == "predicted" else "measured") if len(bars) <= 3 else src[:4] + "."
            ax.text(xpos, bottom, tag, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(bars)))
    diff_tag = "measured − predicted: " if len(bars) <= 2 else "Δ "
    ax.set_xticklabels([f"{label}\n{diff_tag}{C.fmt_signed_bytes(r.diff['total'])}"
                        for label, r in bars], fontsize=8.5 if len(bars) <= 4 else 7)
    for lab, (_, r) in zip(ax.get_xticklabels(), bars):
        lab.set_color("#2a7d2a" if r.agrees else "#b00020")
    ax.set_ylabel(f"bytes held ({C.unit_note(unit)})")
    ax.set_ylim(0, (max(tops) / div if tops else 1) * 1.3)
    when = f"after step {lm.step}" if lm.phase == "after_step" else "between steps"
    ax.set_title(f"Live: {lm.strategy}, {lm.optimizer}, {lm.world_size} ranks ({when})\n"
                 "exact prediction vs measured (hatched)", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)


# ----------------------------------------------------------------- widget
def _live_defaults(lm: LiveMemory | None) -> dict:
    if lm is None:
        return {}
    return {"n_params": float(lm.n_params), "dp": lm.world_size, "optimizer": lm.optimizer,
            "strategy": lm.strategy, "precision": lm.precision}


def view(cluster=None, *, n_params: float = 7e9, dp: int = 8, precision: str = "bf16-mixed",
         optimizer: str = "adam", capacity_gb: float = 80.0, fp32_grad_accum: bool = False,
         offload: str = "none", strategy: str | None = None, live: LiveMemory | None = None):
    """The memory widget.  With ``cluster`` the model size, DP, precision and
    optimizer come from the wrapped model, and measured bars are shown."""
    if cluster is not None and live is None:
        live = fetch(cluster)
    dflt = _live_defaults(live)
    n_params = dflt.get("n_params", n_params)
    dp = dflt.get("dp", dp)
    precision = dflt.get("precision", precision)
    optimizer = dflt.get("optimizer", optimizer)
    strategy = dflt.get("strategy", strategy)

    controls = {
        "n_params": C.log_slider("parameters", n_params, 3, 12.5, 0.05, fmt=".3g"),
        "dp": C.int_slider("DP", dp, 1, 1024),
        "precision": C.dropdown("precision", PRECISIONS, precision),
        "optimizer": C.dropdown("optimizer", OPTIMIZERS, optimizer),
        "capacity_gb": C.float_slider("device (GB)", capacity_gb, 1, 288, 1, fmt=".0f"),
        "offload": C.dropdown("offload", OFFLOADS, offload),
        "fp32_grad_accum": w.Checkbox(value=fp32_grad_accum, description="fp32 grad accumulation"),
    }

    def compute(v: dict) -> MemoryView:
        return data(v["n_params"], v["dp"], v["precision"], v["optimizer"], v["capacity_gb"],
                    fp32_grad_accum=v["fp32_grad_accum"], offload=v["offload"], strategy=strategy, live=live)

    return C.viewbox("ZeRO memory per rank" + (" (live)" if live else ""), controls, compute, figure, html, text,
                     layout_rows=[["n_params", "dp", "capacity_gb"], ["precision", "optimizer", "offload"],
                                  ["fp32_grad_accum"]])


def _args(kw: dict) -> dict:
    keys = ("n_params", "dp", "precision", "optimizer", "capacity_gb", "fp32_grad_accum", "offload", "strategy",
            "stages")
    return {k: kw[k] for k in keys if k in kw}


def _live_kw(cluster, kw: dict) -> dict:
    if cluster is None:
        return kw
    lm = fetch(cluster)
    return {**kw, **_live_defaults(lm), "live": lm}


def show(cluster=None, **kw: Any) -> None:
    """Widget + static copy in a kernel; the summary and tables in a terminal."""
    if C._in_kernel() and kw.get("stages", True):
        C.show_view(view(cluster, **kw))
        return
    # a terminal, or the live model alone (nothing for the stage controls to change)
    kw = _live_kw(cluster, kw)
    C.show_static(data(**_args(kw), live=kw.get("live")), figure, html, text)


def save(path: str, cluster=None, **kw: Any) -> str:
    kw = _live_kw(cluster, kw)
    return C.save_figure(figure(data(**_args(kw), live=kw.get("live"))), path)
