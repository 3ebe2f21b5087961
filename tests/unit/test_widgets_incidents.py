"""``%dp incidents``' view (dpnb.widgets.incidents): the faults on the run's
timeline beside its steps, merged from every rank's thinned series."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import matplotlib.colors as mcolors

from dpnb.core.incidents import Incident
from dpnb.engine.metrics.views import step_series
from dpnb.engine.state import STATE_NAME
from dpnb.session import Cluster
from dpnb.widgets import incidents as view

STARTED = 1000.0
INCIDENTS = (Incident(1010.0, "died", (1,), "killed by signal 9 (SIGKILL)"),
             Incident(1010.5, "group broken", (), "it cannot continue without rank 1"),
             Incident(1012.0, "replaced", (1,)), Incident(1013.0, "healthy"))


def _series():
    """Rank 0 from the start; rank 1 replaced at 1012 s, so its own steps begin
    after the fault; steps 8 and 9 trained again after a roll-back (1013.5 s on)."""
    r0 = [[s, 1001.0 + s, 2.0 - s / 10, 100.0] for s in range(10)]
    r0 += [[8, 1013.5, 1.25, 90.0], [9, 1014.0, 1.15, 95.0]]
    r1 = [[8, 1013.6, 1.25, 90.0], [9, 1014.1, 1.15, 95.0]]  # the same steps, 0.1 s apart
    return {0: r0, 1: r1}


def test_merge_keeps_a_step_once_across_ranks_and_twice_when_trained_again():
    pts = view.merge(_series(), STARTED)
    assert [p.step for p in pts] == list(range(10)) + [8, 9]  # time order, no rank twice
    assert [p.at_s for p in pts][:2] == [1.0, 2.0]  # seconds since the cluster started
    assert pts[-2].at_s == 13.5 and pts[-1].samples_per_s == 95.0


def test_each_fault_is_a_line_in_both_panels_with_its_time_to_healthy_shaded():
    d = view.data(INCIDENTS, STARTED, _series())
    assert [(r.kind, r.at_s, r.healthy_after_s) for r in d.rows] == [
        ("died", 10.0, 3.0), ("group broken", 10.5, 2.5)]
    fig = view.figure(d)
    loss_ax, rate_ax = fig.axes[:2]
    for ax in (loss_ax, rate_ax):
        vlines = [(ln.get_xdata()[0], mcolors.to_hex(ln.get_color())) for ln in ax.lines
                  if len(set(ln.get_xdata())) == 1 and len(ln.get_xdata()) == 2]
        assert vlines == [(10.0, mcolors.to_hex("tab:red")), (10.5, mcolors.to_hex("tab:orange"))]
        spans = sorted(round(p.get_extents().width, 3) > 0 for p in ax.patches)
        assert len(ax.patches) == 2 and all(spans)
    assert list(loss_ax.lines[0].get_xdata()) == [p.at_s for p in d.steps]
    out = view.text(d)
    assert "died         rank 1: killed by signal 9 (SIGKILL) (healthy 3.0 s later)" in out
    assert "2 faults; healthy again after each: median 2.8 s, longest 3.0 s" in out
    assert "steps 0..9 recorded between 1.0 s and 14.0 s (ranks 0,1;" in out
    assert ">died</td>" in view.html(d) and ">2.5</td>" in view.html(d)


def test_a_run_without_steps_or_faults_says_so():
    d = view.data((), STARTED, {})
    assert view.text(d).splitlines()[-2:] == [
        "no faults", "no training steps recorded: wrap a model and %dp train to see them here"]
    view.figure(d)  # draws an empty run without failing


def _ns(n: int) -> dict:
    recs = deque(SimpleNamespace(step=s, t_end=100.0 + s, loss=1.0 / (s + 1), samples_per_s=50.0)
                 for s in range(n))
    return {STATE_NAME: SimpleNamespace(train=SimpleNamespace(records=recs))}


def test_the_engines_series_is_thinned_evenly_and_keeps_the_last_step():
    assert step_series({STATE_NAME: SimpleNamespace(train=None)}) == []  # nothing wrapped
    assert [r[0] for r in step_series(_ns(5), max_points=10)] == [0, 1, 2, 3, 4]
    got = step_series(_ns(10_001), max_points=100)
    steps = [r[0] for r in got]
    assert len(got) <= 100 and steps[0] == 0 and steps[-1] == 10_000
    gaps = {b - a for a, b in zip(steps, steps[1:-1])}
    assert gaps == {102}, gaps  # even, but for the last step
    assert got[-1] == [10_000, 10_100.0, 1.0 / 10_001, 50.0]


class _Cluster(Cluster):
    """The session's side of the view, on plain state: its incidents, rank 1 dead
    (never asked), and each rank's step series through ``call``."""

    world_size, created, dead, busy = 3, STARTED, {1: "killed"}, set()
    incidents, kept_steps = INCIDENTS, ()
    training = SimpleNamespace(last_wrap=object())
    transport = SimpleNamespace(find_dead=lambda ranks: {}, frozen=lambda ranks: {})

    def __init__(self):  # none of the runtime: only what run_log and call read
        self.asked = []

    def call(self, dotted, *args, ranks=None, raise_errors=True):
        self.asked.append((dotted, args, tuple(ranks)))
        series = _series()
        values = [series.get(r, []) for r in ranks]
        return SimpleNamespace(ok=True, values=values, ranks=list(ranks))


def test_the_view_reads_each_live_rank_and_its_refresh_reads_again(capsys):
    c = _Cluster()
    box = view.view(c)
    # rank by rank (one that fails fails alone), rank 1 dead: never asked
    assert c.asked == [("dpnb.engine.metrics.views.step_series", (), (r,)) for r in (0, 2)]
    assert [p.step for p in box.data.steps] == list(range(10)) + [8, 9]  # rank 0's alone
    assert box.data.ranks_read == (0,)  # rank 2 sent none: no model there
    [again] = [b for b in box.children if getattr(b, "description", "") == "refresh"]
    again.click()
    assert len(c.asked) == 4
    view.show(c)  # not in a kernel: the text
    assert "steps 0..9 recorded" in capsys.readouterr().out


def test_steps_kept_before_a_restart_are_drawn_after_every_rank_was_replaced():
    """keep_steps (the session's, before a restart or resize) reads the idle ranks'
    series into the notebook; once every rank has been replaced since, the view
    still draws the run from its start."""
    c = _Cluster()
    c.keep_steps()
    assert [a[2] for a in c.asked] == [(0,), (2,)]  # rank by rank: one gone fails alone
    assert [r[0] for r in c.kept_steps] == list(range(10)) + [8, 9]
    c.call = lambda dotted, *a, ranks=None, raise_errors=True: SimpleNamespace(
        ok=True, values=[[] for _ in ranks], ranks=list(ranks))  # fresh ranks: no records
    d = view.of(c)
    assert [p.step for p in d.steps] == list(range(10)) + [8, 9] and d.kept
    assert "and those kept before ranks were replaced" in view.text(d)


def test_a_rank_gone_or_frozen_before_the_restart_is_not_asked_and_one_failing_fails_alone():
    c = _Cluster()
    c.transport = SimpleNamespace(find_dead=lambda ranks: {0: "killed"},  # gone, not yet known
                                  frozen=lambda ranks: {})
    c.keep_steps()
    assert [a[2] for a in c.asked] == [(2,)]  # rank 0 never asked
    c = _Cluster()
    c.transport = SimpleNamespace(find_dead=lambda ranks: {}, frozen=lambda ranks: {2: "stopped"})
    c.keep_steps()
    assert [a[2] for a in c.asked] == [(0,)]  # a frozen rank would hold the call: not asked
    c, real = _Cluster(), _Cluster.call

    def call(self, dotted, *args, ranks=None, raise_errors=True):
        if ranks == [0]:
            raise KeyError(0)  # its engine dropped by the controller meanwhile
        return real(self, dotted, *args, ranks=ranks, raise_errors=raise_errors)

    c.call = call.__get__(c)
    c.keep_steps()  # rank 2 still read
    assert [a[2] for a in c.asked] == [(2,)] and c.kept_steps == ()  # rank 2 has no steps
    # the view reads through the same rank-by-rank reader: rank 0's failure costs
    # only rank 0's steps, never the view
    d = view.of(c)
    assert [a[2] for a in c.asked] == [(2,), (2,)] and d.ranks_read == () and d.rows
