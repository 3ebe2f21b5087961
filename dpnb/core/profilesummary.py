"""What a profiled cell says, in words: one wording for the cell's view and JupyterLab's panel.

The distributed story is :mod:`dpnb.core.profile`'s: every rank waits in a
collective for the last one to enter it, so the sentences name the rank the
others waited for (the straggler), the busiest rank, the clock the ranks were
put on and where the traces are.  :func:`sentences` is what ``%dp profile``
prints above its tables (:mod:`dpnb.widgets.profile`); :func:`summarize`
makes of the same sentences a small, bounded record -- no trace contents, a
few lines and two numbers per rank -- that the notebook's session hands the
runtime to publish for the JupyterLab sidebar's panel
(:meth:`dpnb.cluster.publish.Publication.profile`), so the panel beside the
notebook says exactly what the cell's output says.

Pure Python: reads a :class:`~dpnb.core.profile.Profiled` only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .profile import Profiled, RankStats

#: ranks whose compute / exposed seconds the summary carries (the rest: ``more_ranks``)
MAX_RANKS = 64
#: characters of the failure line the summary carries (it is one line of an error)
MAX_FAILURE = 300


def ms(s: float | None) -> str:
    """Seconds as the view writes them: ``12.34 ms`` (``—`` for none)."""
    return "—" if s is None else f"{s * 1e3:.2f} ms"


def failure_note(what: str, failure: str) -> str:
    """The note a profile of a failed cell carries (the partial profile is still shown)."""
    return f"the {what} failed: {failure} (what ran before is shown)"


def straggler_line(p: Profiled) -> str | None:
    """The sentence naming the rank every other rank waited for; None when none was late."""
    st = p.report.straggler
    if st is None or st.total_late_s <= 0:
        return None
    return (f"Straggler: rank {st.rank} entered {st.last_at} of {st.of} collectives last, "
            f"typically {st.typical_late_s * 1e3:.2f} ms after the first rank (median), up to "
            f"{st.max_late_s * 1e3:.2f} ms ({st.total_late_s * 1e3:.1f} ms in all, waited "
            f"by every other rank).")


def clock_line(p: Profiled) -> str:
    """How the ranks' traces were put on one clock."""
    return f"Clock: {p.report.clock_note}."


def traces_line(p: Profiled) -> str:
    """Where the traces are, and which one opens every rank at once."""
    return f"Traces: {p.folder} (rank<R>.json; merged.json opens in ui.perfetto.dev)."


def sentences(p: Profiled) -> list[str]:
    """The sentences above the tables: the straggler, the busiest rank, the link, the clock, the files."""
    rep = p.report
    out = [f"Profiled {p.what} on {len(rep.ranks)} of {rep.world_size} ranks."]
    st = straggler_line(p)
    if st is not None:
        out.append(st)
    busy: RankStats | None = rep.busiest()
    if busy is not None:
        out.append(f"Most compute: rank {busy.rank}, {ms(busy.compute_s)} of a "
                   f"{ms(busy.window_s)} window ({ms(busy.exposed_s)} exposed communication, "
                   f"{ms(busy.idle_s)} idle).")
    if rep.link is not None:
        out.append(f"Model link: {rep.link.name} (β {rep.link.bandwidth_Bps / 1e9:.3g} GB/s, "
                   f"α {rep.link.latency_s * 1e6:.3g} µs; {rep.link.note}).")
    out.append(clock_line(p))
    out.append(traces_line(p))
    return out


@dataclass(frozen=True)
class RankSplit:
    """One rank's compute and exposed communication in the profiled window (seconds)."""

    rank: int
    compute_s: float
    exposed_s: float


@dataclass(frozen=True)
class ProfileSummary:
    """A profiled cell, small enough to publish: the view's sentences, two numbers per rank,
    where the traces are.  Bounded: at most :data:`MAX_RANKS` ranks, one failure line."""

    folder: str  # rank<R>.json and merged.json
    merged: str  # the merged trace's file name (ui.perfetto.dev opens it)
    what: str  # "cell", "train"
    at: float  # when the profile ended (seconds since the epoch)
    world_size: int
    profiled_ranks: int
    straggler: str | None  # straggler_line's sentence
    clock: str  # clock_line's sentence
    failure: str  # failure_note's line ("" when the cell succeeded)
    lines: tuple[str, ...]  # sentences(): what the cell's view prints above its tables
    ranks: tuple[RankSplit, ...]
    more_ranks: int  # profiled ranks left out of ``ranks``

    def as_dict(self) -> dict:
        """Plain JSON types (lists for tuples)."""
        return asdict(self)


def summarize(p: Profiled) -> ProfileSummary:
    """The publishable summary of ``p``, in :func:`sentences`' words."""
    stats = p.report.stats
    failure = failure_note(p.what, p.failure)[:MAX_FAILURE] if p.failure else ""
    return ProfileSummary(
        folder=p.folder, merged=p.merged_path.rsplit("/", 1)[-1], what=p.what, at=p.at,
        world_size=p.report.world_size, profiled_ranks=len(p.report.ranks),
        straggler=straggler_line(p), clock=clock_line(p), failure=failure,
        lines=tuple(sentences(p)),
        ranks=tuple(RankSplit(s.rank, s.compute_s, s.exposed_s) for s in stats[:MAX_RANKS]),
        more_ranks=max(0, len(stats) - MAX_RANKS))
