"""What happened to my run (``%dp incidents``): each fault on the run's own
timeline, beside its loss and throughput.

The distributed story.  The notebook writes down every change in the
cluster's health as it sees it (:mod:`dpnb.core.incidents`: a rank died, a
call was given up on, the group broke, healthy again); the engines write down
every training step (its loss, samples/s and wall clock, ``StepRecord``).
Neither alone says what a fault cost: the incidents say when, the steps say
what training did around it -- the gap where nothing was trained, the steps
trained again after a roll-back, the rate once the ranks were back.

The view asks each live rank for a thinned series of its steps (the
session's ``step_series``: one call per rank, no collective, so a broken
group or a busy peer does not stop it, and a rank that fails is left out
alone) and merges them: a rank replaced during the run lost its own
records, and any survivor holds the same steps.  A step trained twice (after a roll-back to a
snapshot) is kept twice, at its two times.  Times are seconds since the
cluster started, on the notebook's clock; the engines' wall clocks are the
hosts' (the same clock on one host, NTP's agreement across hosts).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import ipywidgets as w
from matplotlib.lines import Line2D

from dpnb.core.incidents import (IncidentRow, merge_steps,
                                 rows as incident_rows, text as incident_text)
from . import _common as C

#: each fault kind's colour, in the figure and its legend
COLOURS = {"died": "tab:red", "still busy": "tab:purple", "group broken": "tab:orange"}


@dataclass(frozen=True)
class StepPoint:
    """One training step as a rank recorded it: seconds since the cluster started."""

    step: int
    at_s: float
    loss: float
    samples_per_s: float | None


@dataclass(frozen=True)
class IncidentsView:
    """The run's faults (each with its time to healthy) and its steps, on one clock."""

    rows: tuple[IncidentRow, ...]
    steps: tuple[StepPoint, ...]
    ranks_read: tuple[int, ...] = ()  # the ranks whose steps are drawn (live ones)
    kept: bool = False  # steps the notebook kept before a restart or resize are drawn too

    @property
    def healed(self) -> list[float]:
        return [r.healthy_after_s for r in self.rows if r.healthy_after_s is not None]


def merge(series: dict[int, list], started: float, kept=()) -> list[StepPoint]:
    """Every rank's ``[step, t_end, loss, samples_per_s]`` rows, and the notebook's
    ``kept`` ones, as one series in time order (:func:`merge_steps`)."""
    return [StepPoint(s, round(t - started, 3), lo, sps)
            for s, t, lo, sps in merge_steps([kept, *series.values()])]


def data(incidents, started: float, series: dict[int, list] | None = None,
         kept=()) -> IncidentsView:
    """The view's data from the notebook's incidents, the ranks' step series and
    the steps the notebook kept before ranks were replaced."""
    series = series or {}
    return IncidentsView(tuple(incident_rows(tuple(incidents), started)),
                         tuple(merge(series, started, kept)), tuple(sorted(series)),
                         bool(kept))


def _summary(d: IncidentsView) -> list[str]:
    n, healed = len(d.rows), d.healed
    if not n:
        head = "no faults"
    elif len(healed) == n:
        head = (f"{n} fault{'s' if n > 1 else ''}; healthy again after each: median "
                f"{statistics.median(healed):.1f} s, longest {max(healed):.1f} s")
    else:
        head = f"{n} fault{'s' if n > 1 else ''}; {n - len(healed)} not healthy since"
    lines = [head]
    if d.steps:
        lines.append(f"steps {d.steps[0].step}..{d.steps[-1].step} recorded between "
                     f"{d.steps[0].at_s:.1f} s and {d.steps[-1].at_s:.1f} s (ranks "
                     f"{','.join(map(str, d.ranks_read))}"
                     f"{', and those kept before ranks were replaced' if d.kept else ''}; "
                     f"a step trained again after a roll-back is drawn twice)")
    else:
        lines.append("no training steps recorded: wrap a model and %dp train to see them here")
    return lines


def text(d: IncidentsView) -> str:
    return incident_text(list(d.rows)) + "\n" + "\n".join(_summary(d))


def html(d: IncidentsView) -> str:
    body = [[f"{r.at_s:.1f}", r.kind, ",".join(map(str, r.ranks)) or "the group",
             r.detail or "-",
             "not since" if r.healthy_after_s is None else f"{r.healthy_after_s:.1f}"]
            for r in d.rows]
    table = C.html_table(["at (s)", "kind", "ranks", "what", "healthy after (s)"], body,
                         caption="faults") if body else ""
    return C.html_lines(_summary(d)) + table


def figure(d: IncidentsView):
    """Loss and samples/s over the run's seconds; each fault a line in its kind's
    colour, shaded until the cluster was healthy again."""
    fig = C.new_figure(4.6)
    ax_loss, ax_rate = fig.subplots(2, 1, sharex=True)
    t = [p.at_s for p in d.steps]
    ax_loss.plot(t, [p.loss for p in d.steps], ".", ms=2, color="0.3")
    ax_loss.set_ylabel("loss")
    rate = [(p.at_s, p.samples_per_s) for p in d.steps if p.samples_per_s is not None]
    ax_rate.plot([x for x, _ in rate], [y for _, y in rate], ".", ms=2, color="0.3")
    ax_rate.set_ylabel("samples/s (per step)")
    ax_rate.set_xlabel("seconds since the cluster started")
    for r in d.rows:
        col = COLOURS.get(r.kind, "grey")
        for ax in (ax_loss, ax_rate):
            ax.axvline(r.at_s, color=col, lw=1.0)
            if r.healthy_after_s:
                ax.axvspan(r.at_s, r.at_s + r.healthy_after_s, color=col, alpha=0.15, lw=0)
    ax_loss.set_title(_summary(d)[0])
    kinds = [k for k in COLOURS if any(r.kind == k for r in d.rows)]
    if kinds:
        ax_loss.legend(handles=[Line2D([], [], color=COLOURS[k], label=k) for k in kinds],
                       loc="upper right", fontsize=8)
    if not d.steps and not d.rows:
        ax_loss.text(0.5, 0.5, "nothing happened yet", ha="center", va="center",
                     transform=ax_loss.transAxes)
    return fig


def of(cluster) -> IncidentsView:
    """This cluster's view now."""
    log = cluster.run_log()
    return data(log.incidents, log.started, cluster.step_series(log.idle_ranks), log.kept_steps)


def view(cluster):
    """The widget: the figure and the faults' table, and a button that reads the
    cluster again (the faults since, and the steps trained since)."""
    state = {"d": of(cluster)}
    again = w.Button(description="refresh", tooltip="read the incidents and the ranks' steps again")
    box = C.viewbox("What happened to this run", {}, lambda _v: state["d"], figure, html, text,
                    extra=[again])

    def refresh(_b) -> None:
        state["d"] = of(cluster)
        box.refresh()

    again.on_click(refresh)
    return box


def show(cluster, **kw: Any) -> None:
    """In a kernel the widget with its static copy (figure, table, text: kept in a
    saved notebook); elsewhere the text, without drawing the figure."""
    if C._in_kernel():
        C.show_view(view(cluster))
    else:
        print(text(of(cluster)))


def save(path: str, cluster, **kw: Any) -> str:
    return C.save_figure(figure(of(cluster)), path)
