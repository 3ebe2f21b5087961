"""Global batch (``%dp batch``): micro-batch × DP × grad-accum, tokens, LR scaling, DP × TP × PP.

The distributed story: each of the DP ranks runs ``grad_accum`` micro-batches
of ``micro_batch`` samples per optimizer step; gradients are summed locally
(no communication) and all-reduced once, in the last micro-batch's backward.
So one step sees micro_batch × DP × grad_accum samples (× seq_len tokens).
The learning rate keys off that *global* batch.  With tensor and pipeline
parallelism each replica spans TP × PP GPUs, so GPUs = DP × TP × PP.

All numbers come from :mod:`dpnb.core.batch`.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as w
from matplotlib.patches import Patch, Rectangle

from dpnb.core import (
    BatchConfig,
    ConfigError,
    Parallelism,
    factor_world,
    scale_lr,
    solve_grad_accum,
)

from ..core.viewsource import ViewSource
from dpnb.engine import entrypoints as ep
from . import _common as C

MAX_DRAWN = 16  # ranks / micro-steps drawn individually in the grid


@dataclass(frozen=True)
class BatchView:
    """What the batch view shows.

    ``config``: the layout; ``global_samples``/``global_tokens``;
    ``solution``: grad-accum needed for ``target_tokens`` (None without a
    target); ``lr``: rule → scaled LR; ``parallelism``: DP × TP × PP;
    ``gpus``: the GPU count given (or DP × TP × PP); ``warnings``: the
    factoring / target messages; ``live``: what was filled from a cluster.
    """

    config: BatchConfig
    global_samples: int
    global_tokens: int
    target_tokens: int | None
    solution: Any
    ref_lr: float
    ref_batch: int
    lr: dict
    parallelism: Parallelism
    gpus: int
    warnings: tuple[str, ...] = ()
    live: dict = field(default_factory=dict)


def data(micro_batch: int = 4, dp: int = 8, grad_accum: int = 1, seq_len: int = 4096,
         target_tokens: int | None = 4 * 2**20, ref_lr: float = 3e-4, ref_batch: int = 256,
         tp: int = 1, pp: int = 1, gpus: int | None = None, live: dict | None = None) -> BatchView:
    """Compute the batch view.  ``ref_batch`` is a *global* batch in samples.

    ``gpus``: GPUs available; when given, DP × TP × PP must equal it (the
    factoring warning says what to change otherwise).  ``target_tokens``:
    the global batch to reach, solved for grad-accum with the other knobs
    fixed (:func:`dpnb.core.solve_grad_accum`).
    """
    cfg = BatchConfig(int(micro_batch), int(dp), int(grad_accum), int(seq_len))
    par = Parallelism(cfg.dp, int(tp), int(pp))
    warnings: list[str] = []
    n_gpus = par.world_size if not gpus else int(gpus)
    if gpus:
        try:
            f = factor_world(int(gpus), int(tp), int(pp))
            if f.dp != cfg.dp:
                warnings.append(
                    f"{gpus} GPUs with TP={tp}, PP={pp} give DP = {gpus} / ({tp} × {pp}) = {f.dp}, "
                    f"not the DP={cfg.dp} chosen: set DP to {f.dp} or change the GPU count to {par.world_size}")
        except ConfigError as e:
            warnings.append(str(e))
    sol = None
    if target_tokens:
        sol = solve_grad_accum(cfg.micro_batch, cfg.dp, target_tokens=int(target_tokens), seq_len=cfg.seq_len)
        if not sol.exact:
            warnings.append(sol.message)
    lrs = {rule: scale_lr(float(ref_lr), int(ref_batch), cfg.global_samples, rule)
           for rule in ("linear", "sqrt", "none")}
    return BatchView(cfg, cfg.global_samples, cfg.global_tokens, int(target_tokens) if target_tokens else None,
                     sol, float(ref_lr), int(ref_batch), lrs, par, n_gpus, tuple(warnings), dict(live or {}))


def readout_lines(d: BatchView) -> list[str]:
    c = d.config
    lines = [
        f"global batch = micro_batch {c.micro_batch} × DP {c.dp} × grad_accum {c.grad_accum} "
        f"= {d.global_samples:,} samples",
        f"             × seq_len {c.seq_len:,} = {d.global_tokens:,} tokens ({C.fmt_count(d.global_tokens)} tokens)",
    ]
    if d.solution is not None:
        s = d.solution
        lines.append(
            f"target {d.target_tokens:,} tokens → grad_accum {'=' if s.exact else '≈'} {s.grad_accum} "
            f"({s.achieved:,} tokens{'' if s.exact else ', inexact'})")
    lines.append(
        f"LR for ref {d.ref_lr:g} at {d.ref_batch:,} samples: linear {d.lr['linear']:.4g}, "
        f"sqrt {d.lr['sqrt']:.4g} (×{d.global_samples / d.ref_batch:.4g} batch)")
    lines.append(f"GPUs = {d.parallelism.describe()}" + (f" (given {d.gpus})" if d.gpus != d.parallelism.world_size else ""))
    if d.live:
        lines.append("live: " + ", ".join(f"{k}={v}" for k, v in d.live.items()))
    return lines


def text(d: BatchView) -> str:
    out = ["Global batch"] + ["  " + s for s in readout_lines(d)]
    out += ["  WARNING: " + w for w in d.warnings]
    return "\n".join(out)


def html(d: BatchView) -> str:
    return C.html_lines(readout_lines(d), d.warnings)


def figure(d: BatchView):
    """Left: the global batch as a grid of micro-batches (DP ranks × grad-accum
    micro-steps); right: scaled LR vs global batch, linear and sqrt."""
    c = d.config
    fig = C.new_figure(4.2)
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.25, 1])
    cols = _drawn(c.dp)
    rows = _drawn(c.grad_accum)
    nx, ny = len(cols), len(rows)
    for i, rank in enumerate(cols):
        for k, micro in enumerate(rows):
            last = micro == c.grad_accum - 1
            r = Rectangle((i + 0.05, k + 0.05), 0.9, 0.9,
                          facecolor=C.COLORS["all_reduce"] if last else C.COLORS["backward"],
                          alpha=0.85, edgecolor="white")
            r._dpnb_cell = (rank, micro)
            ax.add_patch(r)
            if nx <= 8 and ny <= 8:
                ax.text(i + 0.5, k + 0.5, str(c.micro_batch), ha="center", va="center", color="white", fontsize=9)
    if c.dp > MAX_DRAWN:
        ax.axvline(nx - 1, color="black", ls=":", lw=1.5)
    if c.grad_accum > MAX_DRAWN:
        ax.axhline(ny - 1, color="black", ls=":", lw=1.5)
    ax.set_xlim(0, nx)
    ax.set_ylim(ny, 0)
    skipped = " (dotted line: some not drawn)" if (c.dp > MAX_DRAWN or c.grad_accum > MAX_DRAWN) else ""
    ax.set_xlabel(f"data-parallel rank (DP = {c.dp}){skipped}")
    ax.set_ylabel(f"micro-step (grad_accum = {c.grad_accum})")
    ax.set_xticks([i + 0.5 for i in range(nx)])
    ax.set_xticklabels([str(r) for r in cols], fontsize=8 if nx <= 10 else 7)
    ax.set_yticks([k + 0.5 for k in range(ny)])
    ax.set_yticklabels([str(k) for k in rows], fontsize=8)
    ax.set_aspect("auto")
    ax.set_title(f"Global batch: {c.micro_batch} × {c.dp} × {c.grad_accum} = {d.global_samples:,} samples\n"
                 f"= {C.fmt_count(d.global_tokens)} tokens at seq_len {c.seq_len:,}", fontsize=11)

    ax.legend(handles=[Patch(color=C.COLORS["backward"], label="micro-batch, grads summed locally (no_sync)"),
                       Patch(color=C.COLORS["all_reduce"], label="last micro-batch: all-reduce in backward")],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=1, frameon=False)

    lo = max(1, min(d.ref_batch, d.global_samples) // 8)
    hi = max(d.ref_batch, d.global_samples) * 8
    xs = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    ax2.plot(xs, [d.ref_lr * x / d.ref_batch for x in xs], label="linear rule (Goyal et al. 2017)",
             color=C.COLORS["all_reduce"])
    ax2.plot(xs, [d.ref_lr * math.sqrt(x / d.ref_batch) for x in xs], label="sqrt rule (Krizhevsky 2014)",
             color=C.COLORS["backward"])
    ax2.plot([d.ref_batch], [d.ref_lr], "ko", label=f"reference: {d.ref_lr:g} at {d.ref_batch:,}")
    ax2.axvline(d.global_samples, color="gray", ls="--", lw=1)
    ax2.plot([d.global_samples] * 2, [d.lr["linear"], d.lr["sqrt"]], "s", color="gray", ms=5)
    ax2.annotate(f"this batch: {d.global_samples:,}\nlinear {d.lr['linear']:.3g}\nsqrt {d.lr['sqrt']:.3g}",
                 (d.global_samples, d.lr["sqrt"]), textcoords="offset points", xytext=(6, -34), fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("global batch (samples, log)")
    ax2.set_ylabel("learning rate (log)")
    ax2.set_title("Learning rate scaled to the global batch", fontsize=11)
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(True, which="major", alpha=0.3)
    ax2.minorticks_off()
    if d.warnings:
        lines = textwrap.wrap("⚠ " + d.warnings[0], 150)
        if len(lines) > 2:
            lines = lines[:2]
            lines[1] = lines[1][:146] + " …"
        fig.suptitle("\n".join(lines), fontsize=8, color="#a15c00")
    return fig


def _drawn(n: int) -> list[int]:
    """Indices drawn for n items: all up to MAX_DRAWN, else the first MAX_DRAWN-1 and the last."""
    return list(range(n)) if n <= MAX_DRAWN else list(range(MAX_DRAWN - 1)) + [n - 1]


def live_settings(cluster: ViewSource) -> dict:
    """DP from the running cluster and the last ``%dp train`` settings (rank 0's last record)."""
    live: dict = {"dp": cluster.world_size}
    # the session's last train call, as the session hands it to views
    run = cluster.last_run()
    last = run.settings if run is not None else None
    rec = None
    try:
        summ = C.call_ok(cluster, ep.LIVE_SUMMARY, ranks=[0])[0]
        rec = summ.get("last")
    except C.ViewError:
        rec = None
    src = rec or last
    if src:
        for k in ("micro_batch", "grad_accum", "lr"):
            if src.get(k) is not None:
                live[k] = src[k]
        if src.get("tokens") and src.get("samples"):
            live["seq_len"] = int(src["tokens"] // src["samples"])
        elif src.get("seq_len"):
            live["seq_len"] = int(src["seq_len"])
        else:
            live["seq_len"] = 1  # samples are not token sequences (e.g. regression)
    return live


def view(cluster: ViewSource | None = None, *, micro_batch: int = 4, dp: int = 8, grad_accum: int = 1, seq_len: int = 4096,
         target_tokens: int | None = 4 * 2**20, ref_lr: float = 3e-4, ref_batch: int = 256,
         tp: int = 1, pp: int = 1, gpus: int = 0):
    """The batch widget; with ``cluster`` ("live" mode) DP, micro-batch, grad-accum,
    seq-len and LR are filled from the running cluster and its last training run."""
    live = live_settings(cluster) if cluster is not None else {}
    micro_batch = int(live.get("micro_batch", micro_batch))
    dp = int(live.get("dp", dp))
    grad_accum = int(live.get("grad_accum", grad_accum))
    seq_len = int(live.get("seq_len", seq_len))

    controls = {
        "micro_batch": C.int_slider("micro-batch", micro_batch, 1, 64),
        "dp": C.int_slider("DP", dp, 1, 1024),
        "grad_accum": C.int_slider("grad-accum", grad_accum, 1, 256),
        "seq_len": C.int_slider("seq-len", seq_len, 1, 32768, 1),
        "target_tokens": w.IntText(value=int(target_tokens or 0), description="target tokens",
                                   style={"description_width": "110px"}, layout=w.Layout(width="300px")),
        "ref_lr": C.log_slider("reference LR", ref_lr, -6, 0, 0.05),
        "ref_batch": C.int_slider("ref. batch", ref_batch, 1, 65536),
        "tp": C.int_slider("TP", tp, 1, 64),
        "pp": C.int_slider("PP", pp, 1, 64),
        "gpus": w.IntText(value=int(gpus or 0), description="GPUs (0: DP×TP×PP)",
                          style={"description_width": "110px"}, layout=w.Layout(width="300px")),
    }

    def compute(v: dict) -> BatchView:
        return data(v["micro_batch"], v["dp"], v["grad_accum"], v["seq_len"], v["target_tokens"] or None,
                    v["ref_lr"], v["ref_batch"], v["tp"], v["pp"], v["gpus"] or None, live)

    return C.viewbox("Global batch" + (" (live)" if live else ""), controls, compute, figure, html, text,
                     layout_rows=[["micro_batch", "dp", "grad_accum"], ["seq_len", "target_tokens", "ref_lr"],
                                  ["ref_batch", "tp", "pp"], ["gpus"]])


def show(cluster: ViewSource | None = None, **kw: Any) -> None:
    """Display the widget and a static copy in a kernel; print the summary in a terminal."""
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        live = live_settings(cluster) if cluster is not None else {}
        args = {**kw, **{k: v for k, v in live.items() if k in ("micro_batch", "dp", "grad_accum", "seq_len")}}
        print(text(data(**_data_args(args), live=live)))


def _data_args(kw: dict) -> dict:
    keys = ("micro_batch", "dp", "grad_accum", "seq_len", "target_tokens", "ref_lr", "ref_batch", "tp", "pp", "gpus")
    return {k: kw[k] for k in keys if k in kw}


def save(path: str, cluster: ViewSource | None = None, **kw: Any) -> str:
    """Write the figure (PNG or SVG by extension) for the given inputs."""
    live = live_settings(cluster) if cluster is not None else {}
    args = {**kw, **{k: v for k, v in live.items() if k in ("micro_batch", "dp", "grad_accum", "seq_len")}}
    return C.save_figure(figure(data(**_data_args(args), live=live)), path)
