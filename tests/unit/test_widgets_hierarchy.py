"""The flat vs two-level view from synthetic per-rank timings (no cluster)."""

from types import SimpleNamespace

import pytest

from dpnb.core import Link, collective_time
from dpnb.widgets import hierarchy as H
from dpnb.widgets._common import ViewError

INTRA, SHARE = Link("intra", 1e9, 50e-6), Link("share", 62.5e6, 200e-6)


def _ranks(hosts=2, g=2, sizes=(1 << 20, 4 << 20, 16 << 20, 64 << 20), slow_rank=None):
    """Every rank's bench_hierarchical result, with times from known links."""
    out = []
    for r in range(hosts * g):
        times = {p: [] for p in H.PHASES}
        for s in sizes:
            t = {"flat": collective_time("all_reduce", s, hosts * g, Link("x", 125e6, 200e-6)),
                 "intra": collective_time("all_reduce", s, g, INTRA),
                 "inter": collective_time("all_reduce", s / g, hosts, SHARE),
                 "reduce_scatter": collective_time("reduce_scatter", s, g, INTRA),
                 "all_gather": collective_time("all_gather", s, g, INTRA)}
            t["all_reduce"] = t["inter"]
            t["two_level"] = t["reduce_scatter"] + t["all_reduce"] + t["all_gather"]
            for p in H.PHASES:
                k = 3.0 if r == slow_rank else 1.0
                times[p].append([t[p] * k, t[p] * 1.1 * k, t[p] * 0.9 * k])
        out.append({"rank": r, "hosts": hosts, "per_host": g, "backend": "gloo", "device": "cpu",
                    "sizes": list(sizes), "times": times, "equal": True})
    return out


def test_each_link_is_fitted_on_its_own_and_the_model_matches_its_inputs():
    d = H.data(H.from_ranks(_ranks()))
    assert d.intra.bandwidth_Bps == pytest.approx(1e9, rel=0.05)
    assert d.inter.bandwidth_Bps == pytest.approx(62.5e6, rel=0.05)
    big = d.model[-1]
    assert big.inter_all_reduce_s == pytest.approx(d.bench.t("inter")[-1], rel=0.05)
    # shared NIC: the flat ring's crossing stream gets 2 × 62.5 MB/s = the 125 MB/s it was made with
    assert big.flat_ring_s == pytest.approx(d.bench.t("flat")[-1], rel=0.05)


def test_slowest_rank_per_iteration_is_what_counts():
    hb = H.from_ranks(_ranks(slow_rank=3))
    base = H.from_ranks(_ranks())
    assert hb.t("flat")[0] == pytest.approx(3 * base.t("flat")[0])


def test_text_names_both_links_and_the_speedups():
    out = H.text(H.data(H.from_ranks(_ranks())))
    assert "intra-host link" in out and "inter-host link" in out and "sums equal" in out
    assert "speedup model" in out and "67.11 MB" in out


def test_figure_draws_both_algorithms():
    fig = H.figure(H.data(H.from_ranks(_ranks())))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "flat ring, measured" in labels and "two-level, model" in labels


def _cluster(hosts):
    ranks = [SimpleNamespace(node_rank=h) for h in hosts]
    return SimpleNamespace(world_size=len(hosts), ranks=ranks)


def test_layout_real_pretend_and_mistakes():
    assert H.layout(_cluster([0, 0, 1, 1])) == ([0, 0, 1, 1], False)
    assert H.layout(_cluster([0, 0, 0, 0]), hosts=2) == ([0, 0, 1, 1], True)
    with pytest.raises(ViewError, match="one host"):
        H.layout(_cluster([0, 0, 0, 0]))
    with pytest.raises(ViewError, match="equal hosts"):
        H.layout(_cluster([0, 0, 0, 0]), hosts=3)
