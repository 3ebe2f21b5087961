"""Scaling view: points from dpnb.core.scaling, measured points from step records."""

import pytest

from dpnb.core import LINKS, allreduce_comm, scaling as core_scaling
from dpnb.widgets import scaling


def test_points_are_the_core_model():
    d = scaling.data(compute_ms=200, grad_bytes=2e9, link="ib-ndr-400", overlap=0.6, max_dp=64, samples_per_rank=8)
    ref = core_scaling([1, 2, 4, 8, 16, 32, 64], 0.2, allreduce_comm(2e9, LINKS["ib-ndr-400"]), 0.6, 8)
    assert d.points == tuple(ref)
    assert d.base_throughput == pytest.approx(40.0)
    assert scaling.dp_degrees(48) == [1, 2, 4, 8, 16, 32, 48]


def test_measured_from_records_and_figure():
    recs = [{"step": s, "dp": 2, "samples_per_s": 70.0 + s, "compute_s_all": [0.2, 0.21]} for s in range(5)]
    ms = scaling.measured_from_records(recs)
    assert len(ms) == 1 and ms[0].dp == 2 and ms[0].steps == 4  # first step skipped
    assert ms[0].samples_per_s == pytest.approx(72.5) and ms[0].compute_s == pytest.approx(0.21)
    d = scaling.data(200, 2e9, "ib-ndr-400", 0.6, 16, 8, measured=ms + [scaling.Measured(1, 40.0)])
    fig = scaling.figure(d)
    ax, ax2, ax3 = fig.axes[:3]
    meas = [ln for ln in ax.lines if ln.get_label() == "measured"][0]
    assert list(meas.get_xdata()) == [1, 2] and list(meas.get_ydata()) == [40.0, 72.5]
    model = [ln for ln in ax.lines if ln.get_label() == "model"][0]
    assert list(model.get_ydata()) == pytest.approx([p.throughput for p in d.points])
    eff = [ln for ln in ax2.lines if ln.get_label() == "model"][0]
    assert list(eff.get_ydata()) == pytest.approx([p.efficiency * 100 for p in d.points])
    # step-time bars: compute + exposed = step
    bars = ax3.containers
    comp, exp = bars[0], bars[1]
    for p, c, e in zip(d.points, comp, exp):
        assert c.get_height() + e.get_height() == pytest.approx(p.step_s * 1e3)
    assert "samples/s" in ax.get_ylabel() and "%" in ax2.get_ylabel() and "ms" in ax3.get_ylabel()
    assert "measured DP=2: 72.5 samples/s" in scaling.text(d)


def test_widget_overlap_slider():
    box = scaling.view(compute_ms=100, grad_bytes=1e9, overlap=0.0, max_dp=8)
    e0 = box.data.points[-1].efficiency
    box.controls["overlap"].value = 1.0
    assert box.data.points[-1].efficiency > e0
    assert box.data.points[-1].exposed_comm_s == pytest.approx(0.0)
    box.controls["compute_ms"].value = 0.01
    assert box.error is None
