"""``%dp profile``: one profiled cell of your own code, every rank on one clock.

The distributed story: in synchronous data parallelism every rank waits in
each collective for the last rank to enter it, so one slow rank makes every
rank slow, and communication costs step time only where compute does not
hide it.  The view shows, per rank, a compute lane and a communication lane
(exposed communication hatched red, as in ``%dp gradsync``), a tick where
each rank entered each collective (the last one red: the straggler), and
the split of each rank's window into compute, hidden communication, exposed
communication and idle time; the tables give the collectives' bus bandwidth
beside the α–β model (:mod:`dpnb.core.comm`) and name the straggler.

Reads only :class:`dpnb.core.profile.Profiled` (``cluster.last_profile``,
made by ``%%dp --profile``); nothing is computed here.
"""

from __future__ import annotations

import html as _html
import os
from dataclasses import dataclass
from typing import Any

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from dpnb.core.profile import Profiled, lanes
from dpnb.core.profilesummary import ms, sentences
from dpnb.core.units import fmt_bytes
from dpnb.ranks import parse_ranks

from . import _common as C

#: lanes drawn by default on a large cluster (the rest stay in the tables)
MAX_LANES = 8


@dataclass(frozen=True)
class ProfileView:
    """What the view shows: the profile and the ranks whose lanes are drawn."""

    profiled: Profiled
    shown: tuple[int, ...]  # positions in profiled.report.ranks


def _default_shown(p: Profiled) -> tuple[int, ...]:
    rep = p.report
    n = len(rep.ranks)
    if n <= MAX_LANES:
        return tuple(range(n))
    pos = {r.rank: i for i, r in enumerate(rep.ranks)}
    pick = {0, n - 1}
    for named in (rep.straggler, rep.busiest()):
        if named is not None:
            pick.add(pos[named.rank])
    for i in range(n):  # then the lowest ranks, up to the cap
        if len(pick) >= MAX_LANES:
            break
        pick.add(i)
    return tuple(sorted(pick))


def data(profiled: Profiled | None = None, cluster=None, ranks=None) -> ProfileView:
    """The view of ``profiled`` (default: ``cluster.last_profile``); ``ranks`` picks the lanes."""
    if profiled is None:
        profiled = cluster.last_profile if cluster is not None else None
    if profiled is None:
        raise C.ViewError("no profile yet: run a cell with %%dp --profile first")
    rep = profiled.report
    if ranks is None:
        return ProfileView(profiled, _default_shown(profiled))
    have = [r.rank for r in rep.ranks]
    want = parse_ranks(ranks, rep.world_size)
    missing = [r for r in want if r not in have]
    if missing:
        raise C.ViewError(f"ranks {missing} were not profiled (profiled: {have}); pick among those")
    return ProfileView(profiled, tuple(have.index(r) for r in want))


# ----------------------------------------------------------------- tables
def rank_rows(d: ProfileView) -> list[list[str]]:
    """Per rank: window, compute, communication, hidden %, exposed, idle, forwards."""
    return [[str(s.rank), ms(s.window_s), ms(s.compute_s), ms(s.comm_s), f"{s.overlap_pct:.0f} %",
             ms(s.exposed_s), ms(s.idle_s), str(s.steps or "—")] for s in d.profiled.report.stats]


RANK_HEADERS = ("rank", "window", "compute", "comm", "comm hidden", "exposed comm", "idle", "forwards")
OP_HEADERS = ("collective", "size", "count", "transfer (median)", "bus bw", "α–β model")


def op_rows(d: ProfileView) -> list[list[str]]:
    """Per op and size: count, transfer time, bus bandwidth, the model's time."""
    return [[o.op, fmt_bytes(o.nbytes) if o.nbytes else "?", str(o.count), ms(o.transfer_s),
             f"{o.busbw_Bps / 1e9:.3g} GB/s" if o.busbw_Bps else "—", ms(o.model_s)]
            for o in d.profiled.report.ops]


def summary(d: ProfileView) -> list[str]:
    """The sentences above the tables: the straggler, the slowest rank, the clock, the files
    (:func:`dpnb.core.profilesummary.sentences`, the words JupyterLab's panel shows too)."""
    return sentences(d.profiled)


def text(d: ProfileView) -> str:
    """The terminal summary."""
    lines = summary(d)
    lines += ["", C.text_table(RANK_HEADERS, rank_rows(d))]
    if d.profiled.report.ops:
        lines += ["", C.text_table(OP_HEADERS, op_rows(d))]
    lines += [f"note: {n}" for n in d.profiled.report.notes]
    return "\n".join(lines)


def _links(p: Profiled) -> str:
    """The trace files as links: relative to the notebook's folder, JupyterLab opens them."""
    try:
        rel = os.path.relpath(p.folder)
    except ValueError:  # another drive: no relative link
        return ""
    if rel.startswith(".."):
        return ""
    if p.files:  # the files this profile writes (just after its cell returned)
        files = list(p.files)
    else:
        files = [f for f in ["merged.json"] + [f"rank{r.rank}.json" for r in p.report.ranks]
                 if os.path.isfile(os.path.join(p.folder, f))]
    links = " · ".join(f"<a href='{_html.escape(os.path.join(rel, f))}' target='_blank'>{f}</a>"
                       for f in files)
    return f"<div style='font-size:13px'>Trace files: {links}</div>" if links else ""


def html(d: ProfileView) -> str:
    """The readouts and tables for the notebook."""
    out = C.html_lines(summary(d), warn=d.profiled.report.notes) + _links(d.profiled)
    out += C.html_table(RANK_HEADERS, rank_rows(d), caption="Where each rank's window went")
    if d.profiled.report.ops:
        out += C.html_table(OP_HEADERS, op_rows(d), caption="Collectives: measured beside the model")
    return out


# ----------------------------------------------------------------- figure
def _lanes(ax, d: ProfileView) -> None:
    rep = d.profiled.report
    ylabels = []
    for y0, i in enumerate(d.shown):
        r, ln = rep.ranks[i], lanes(rep, i)
        y = 2 * y0
        C.barh(ax, [(s * 1e3, (e - s) * 1e3) for s, e in ln.compute], y, facecolors=C.COLORS["backward"])
        C.barh(ax, [(s * 1e3, (e - s) * 1e3) for s, e in ln.comm], y + 1, facecolors=C.COLORS["all_reduce"])
        if ln.exposed:  # what the rank sat through
            ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in ln.exposed], (y + 1 - 0.45, 0.9),
                           facecolors="none", edgecolor=C.COLORS["exposed"], hatch="////", linewidth=1)
        ylabels += [f"rank {r.rank} compute", f"rank {r.rank} comm"]
    for c in rep.collectives:  # each rank's entry; the last one red
        last = c.last_rank
        for y0, i in enumerate(d.shown):
            red = i == last and c.lateness_s > 0
            ax.plot([c.arrive_s[i] * 1e3], [2 * y0 + 1.42], marker="v", ms=4 if red else 3,
                    color=C.COLORS["exposed"] if red else "#404040", zorder=3, linestyle="none")
    ax.set_yticks(range(len(ylabels)))
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_ylim(len(ylabels) - 0.4, -0.6)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("time on the common clock (ms)")


def _split(ax, d: ProfileView) -> None:
    stats = [d.profiled.report.stats[i] for i in d.shown]
    parts = (("compute only", lambda s: s.compute_s - s.overlapped_s, C.COLORS["backward"]),
             ("comm hidden by compute", lambda s: s.overlapped_s, C.COLORS["all_reduce_alt"]),
             ("exposed comm", lambda s: s.exposed_s, C.COLORS["exposed"]),
             ("idle", lambda s: s.idle_s, C.COLORS["wait"]))
    for y, s in enumerate(stats):
        x = 0.0
        for _, f, col in parts:
            v = max(0.0, f(s)) * 1e3
            ax.barh(y, v, left=x, color=col, edgecolor="white", height=0.7)
            x += v
    ax.set_yticks(range(len(stats)))
    ax.set_yticklabels([f"rank {s.rank}" for s in stats], fontsize=8)
    ax.set_ylim(len(stats) - 0.4, -0.6)
    ax.set_xlabel("ms of the profiled window")
    ax.legend(handles=[Patch(color=c, label=lab) for lab, _, c in parts], fontsize=7.5, ncol=4,
              loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    ax.grid(True, axis="x", alpha=0.3)


def figure(d: ProfileView):
    """Top: lanes per rank with entries into collectives; bottom: where the window went."""
    n = len(d.shown)
    fig = C.new_figure(max(3.4, 1.6 + 0.5 * n + 0.9 + 0.3 * n))
    ax, ax2 = fig.subplots(2, 1, height_ratios=[2 * n + 1, n + 1.2])
    _lanes(ax, d)
    p = d.profiled
    st = p.report.straggler
    who = (f"; straggler rank {st.rank} (typically +{st.typical_late_s * 1e3:.2f} ms)"
           if st is not None and st.total_late_s > 0 else "")
    handles = [Patch(color=C.COLORS["backward"], label="compute"),
               Patch(color=C.COLORS["all_reduce"], label="communication"),
               Patch(facecolor="none", edgecolor=C.COLORS["exposed"], hatch="////", label="exposed comm"),
               Line2D([], [], marker="v", color="#404040", linestyle="none", label="entry into a collective"),
               Line2D([], [], marker="v", color=C.COLORS["exposed"], linestyle="none", label="last entry")]
    ax.legend(handles=handles, fontsize=7.5, ncol=5, loc="lower left", bbox_to_anchor=(0, 1.0),
              frameon=False, handlelength=1.2, columnspacing=1.0)
    ax.set_title(f"Profiled {p.what}: {len(p.report.ranks)} ranks{who}", fontsize=10, pad=20)
    _split(ax2, d)
    return fig


# ----------------------------------------------------------------- widget
def view(cluster=None, *, profiled: Profiled | None = None, ranks=None):
    """The profile widget: a rank chooser over the lanes."""
    d0 = data(profiled, cluster, ranks)
    rep = d0.profiled.report
    choices = [("default", ""), ("all", "all")] + [(f"rank {r.rank}", str(r.rank)) for r in rep.ranks]
    given = "" if ranks is None else str(ranks)
    if given not in [v for _, v in choices]:
        choices.append((f"ranks {given}", given))
    controls = {"ranks": C.dropdown("lanes", choices, given)}

    def compute(v: dict) -> ProfileView:
        return data(d0.profiled, None, v["ranks"] or None)

    return C.viewbox("Profile", controls, compute, figure, html, text)


def show(cluster=None, **kw: Any) -> None:
    """In a kernel the widget (with a static copy); elsewhere the text."""
    if C._in_kernel():
        C.show_view(view(cluster, **kw))
    else:
        print(text(data(kw.get("profiled"), cluster, kw.get("ranks"))))


def save(path: str, cluster=None, **kw: Any) -> str:
    """Write the figure to ``path`` (.png or .svg)."""
    return C.save_figure(figure(data(kw.get("profiled"), cluster, kw.get("ranks"))), path)


__all__ = ["data", "figure", "text", "html", "view", "show", "save", "ProfileView", "rank_rows", "op_rows"]
