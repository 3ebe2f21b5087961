"""Communication view: α–β curves from dpnb.core, benchmark aggregation, α–β fit."""

import pytest

from dpnb.core import LINKS, Link, bus_factor, collective_time
from dpnb.widgets import comm


def synthetic_bench(link, n=2, kind="all_reduce", jitter=(1.0, 1.3, 1.1)):
    sizes = [1000, 10_000, 100_000, 1_000_000, 10_000_000]
    per = []
    for r in range(n):
        times = [[collective_time(kind, s, n, link) * (j if r == 0 else 1.0) for j in jitter] for s in sizes]
        per.append({"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "kind": kind, "sizes": sizes,
                    "times": times})
    return comm.bench_from_ranks(per)


def test_model_curves_are_core_collective_time():
    d = comm.data("ib-ndr-400", 8)
    lk = LINKS["ib-ndr-400"]
    assert [c.kind for c in d.curves] == ["all_reduce", "reduce_scatter", "all_gather"]
    for c in d.curves:
        for s, t, b in zip(c.sizes, c.times_s, c.busbw):
            assert t == pytest.approx(collective_time(c.kind, s, 8, lk))
            assert b == pytest.approx(s / t * bus_factor(c.kind, 8))
    # large messages: busbw → β
    assert d.curves[0].busbw[-1] == pytest.approx(lk.bandwidth_Bps, rel=1e-3)
    rows = comm._model_rows(d)
    assert rows[1][0] == "100 MB" and rows[1][1] == f"{collective_time('all_reduce', 1e8, 8, lk) * 1e3:.3g} ms"


def test_custom_link_and_errors():
    lk = comm.make_link("pcie-gen4-x16", bandwidth_gbs=10, latency_us=1)
    assert lk.bandwidth_Bps == 10e9 and lk.latency_s == 1e-6
    with pytest.raises(Exception, match="unknown link"):
        comm.data("carrier-pigeon", 4)
    with pytest.raises(Exception, match="n must be"):
        comm.data("ib-ndr-400", 1)


def test_bench_takes_slowest_rank_then_median():
    lk = Link("t", 1e9, 1e-5)
    b = synthetic_bench(lk)
    # rank 0 is slower by the jitter factors (1.0, 1.3, 1.1): slowest per iteration, median = 1.1×
    for s, t in zip(b.sizes, b.times_s):
        assert t == pytest.approx(1.1 * collective_time("all_reduce", s, 2, lk))
    assert b.busbw[0] == pytest.approx(b.algbw[0])  # N = 2: bus factor 1


def test_fit_recovers_alpha_beta():
    lk = Link("t", 3e9, 2e-5)
    b = synthetic_bench(lk, n=4, jitter=(1.0, 1.0, 1.0))
    f = comm.fit_link(b)
    assert f.bandwidth_Bps == pytest.approx(3e9, rel=1e-6)
    assert f.latency_s == pytest.approx(2e-5, rel=1e-6)


def test_figure_overlays_measured_points_on_model():
    b = synthetic_bench(Link("t", 1.5e9, 6e-5))
    d = comm.data("gloo-loopback", 2, ("all_reduce",), bench=b)
    assert d.n == 2 and d.fitted is not None
    fig = comm.figure(d)
    ax, ax2 = fig.axes[:2]
    labels = [ln.get_label() for ln in ax.lines]
    assert "all-reduce model" in labels and "all-reduce measured, N=2" in labels
    meas = [ln for ln in ax.lines if ln.get_label().endswith("measured, N=2")][0]
    assert list(meas.get_ydata()) == pytest.approx([t * 1e3 for t in b.times_s])
    busbw = [ln for ln in ax2.lines if ln.get_label() == "measured busbw"][0]
    assert list(busbw.get_ydata()) == pytest.approx([x / 1e9 for x in b.busbw])
    assert "ms" in ax.get_ylabel() and "GB/s" in ax2.get_ylabel() and "bytes" in ax.get_xlabel()
    txt = comm.text(d)
    # the median iteration is 1.1× the link's time: β / 1.1 and α × 1.1
    assert d.fitted.bandwidth_Bps == pytest.approx(1.5e9 / 1.1) and d.fitted.latency_s == pytest.approx(6.6e-5)
    assert "benchmark: all-reduce on 2 live ranks" in txt and "fitted: β = 1.36 GB/s, α = 66 µs" in txt


def test_widget_link_and_collectives():
    box = comm.view(link="ib-ndr-400", n=8)
    assert box.data.link.name == "ib-ndr-400"
    box.controls["link"].value = "nvlink4-h100"
    assert box.data.link.bandwidth_Bps == 450e9
    box.controls["collectives"].value = ("all_gather",)
    assert [c.kind for c in box.data.curves] == ["all_gather"]
    box.controls["bandwidth_gbs"].value = 100.0
    assert box.data.link.bandwidth_Bps == 100e9
    box.controls["collectives"].value = ()
    assert box.error and "at least one collective" in box.error
