"""Stragglers view: per-rank compute vs step time from records, 1 − (1 − p)^N, injection."""

import pytest

from dpnb.core import straggler_estimate, straggler_probability
from dpnb.widgets import stragglers
from helpers.recorded import stragglers32


def records(n_steps=6, slow_rank=1, delay=0.05):
    out = []
    for s in range(n_steps):
        comp = [0.02 + 0.001 * r for r in range(3)]
        comp[slow_rank] += delay
        out.append({"step": s, "rank": 0, "compute_s_all": comp, "step_time_s": max(comp) + 0.003})
    return out


def test_rows_slowest_rank_and_estimate():
    d = stragglers.data(records(), p=0.01, delays_s=[0.0, 0.05, 0.0])
    assert len(d.steps) == 6 and d.world_size == 3 and d.n == 3
    assert all(r.slowest == 1 for r in d.steps)
    assert d.steps[0].wait_s == pytest.approx((0.05 + 0.001, 0.0, 0.049))
    assert d.delay_s == pytest.approx(0.05)
    base = (0.021 + 0.05 + 0.003) - 0.05
    ref = straggler_estimate(base, 3, 0.01, 0.05)
    assert d.estimate.probability == pytest.approx(ref.probability)
    assert d.estimate.expected_step_s == pytest.approx(ref.expected_step_s)
    assert d.curves[0.01][d.curve_ns.index(64)] == pytest.approx(straggler_probability(0.01, 64))
    txt = stragglers.text(d)
    assert "rank 1 was the slowest in 6 of them" in txt and "injected delay: rank 1 50 ms" in txt


def test_figure_bars_step_lines_and_curve():
    d = stragglers.data(records(4), p=0.05, n=16)
    fig = stragglers.figure(d)
    ax, ax2 = fig.axes[:2]
    assert len(ax.patches) == 4 * 3  # one bar per rank per step
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)[-4:]
    assert heights == [pytest.approx(71.0)] * 4  # the slow rank's 71 ms
    outlined = [p for p in ax.patches if p.get_linewidth() > 1]
    assert len(outlined) == 4  # the slowest rank of each step
    steps = [ln for ln in ax.lines if len(ln.get_xdata()) == 2]
    assert [ln.get_ydata()[0] for ln in steps] == pytest.approx([74.0] * 4)
    assert "ms" in ax.get_ylabel() and "P(" in ax2.get_ylabel()
    dot = [ln for ln in ax2.lines if ln.get_marker() == "o"][0]
    assert dot.get_ydata()[0] == pytest.approx(straggler_probability(0.05, 16))


def test_no_records_message():
    d = stragglers.data([], p=0.01, n=8)
    assert d.steps == () and "P(some rank of 8 is late)" in stragglers.text(d)
    fig = stragglers.figure(d)
    assert "no step records" in fig.axes[0].texts[0].get_text()
    with pytest.raises(Exception, match="probability"):
        stragglers.data([], p=1.5)


class FakeCluster:
    """Records what inject() asks of the ranks (no engines); the ranks' answers to
    ``straggle_state`` are fixed here, so the test sees inject pass them on."""

    world_size = 3
    STATE = [0.5, 0.25, 0.12]  # what the ranks report, in seconds

    def __init__(self):
        self.calls = []

    def call(self, dotted, *args, ranks=None, raise_errors=True, **kw):
        self.calls.append((dotted, args, ranks))
        sel = list(range(3)) if ranks is None else list(ranks)

        class Res:
            ok = True
            values = [{"rank": r, "delay_s": self.STATE[r]} for r in sel]
        return Res()


def test_inject_tells_only_the_chosen_rank_then_reports_every_rank():
    c = FakeCluster()
    assert stragglers.inject(c, 2, 120) == FakeCluster.STATE  # in rank order, as reported
    assert c.calls == [("dpnb.engine.metrics.views.set_straggle", (120.0,), [2]),
                       ("dpnb.engine.metrics.views.straggle_state", (), None)]
    with pytest.raises(stragglers.C.ViewError, match="out of range"):
        stragglers.inject(c, 5, 10)
    stragglers.clear(c)
    assert c.calls[-1] == ("dpnb.engine.metrics.views.set_straggle", (0.0,), None)  # every rank


def test_a_rank_stores_the_delay_in_seconds():
    from dpnb.engine.metrics import views
    from dpnb.engine.state import EngineState

    ns = {"_dpnb": EngineState(rank=1, world_size=2, local_rank=1, local_world_size=2,
                               node_rank=0, backend="gloo", device="cpu", master_addr="x",
                               master_port=1, timeout_s=1.0)}
    views.set_straggle(ns, 120)
    assert views.straggle_state(ns) == {"rank": 1, "delay_s": 0.12}
    with pytest.raises(Exception, match="--delay must be >= 0 milliseconds"):
        views.set_straggle(ns, -1)


def test_widget_p_slider():
    box = stragglers.view(records=records(), p=0.001)
    p0 = box.data.estimate.probability
    box.controls["p"].value = 0.1
    assert box.data.estimate.probability > p0
    box.controls["n"].value = 1024
    assert box.data.estimate.probability == pytest.approx(straggler_probability(0.1, 1024))


def test_estimated_delay_without_injection_on_two_ranks():
    """With no injected delay known, the lateness is read from the records:
    on 2 ranks, the slowest rank minus the other (an upper median would make
    it always 0)."""
    recs = [{"step": i, "compute_s_all": [0.010, 0.110], "step_time_s": 0.12} for i in range(4)]
    d = stragglers.data(recs, p=0.01)
    assert d.delay_s == pytest.approx(0.100)


def test_32_ranks_draw_the_spread_and_name_the_slowest():
    d = stragglers.data(stragglers32(), p=0.01)
    fig = stragglers.figure(d)
    ax = fig.axes[0]
    assert len(ax.patches) == 5  # one min-max bar per step, not 32 per step
    assert len(ax.get_legend().get_texts()) == 4
    names = [t.get_text() for t in ax.texts]
    assert names == ["rank 23"] * 5
    bar = ax.patches[0]
    assert bar.get_y() == pytest.approx(20.0) and bar.get_y() + bar.get_height() == pytest.approx(52.3)
    text = stragglers.text(d)
    assert "rank 23" in text
