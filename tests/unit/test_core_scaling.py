"""Scaling efficiency, stragglers and hierarchical all-reduce."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import (
    LINKS,
    ConfigError,
    Link,
    allreduce_comm,
    expected_step_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    scaling,
    step_time,
    straggler_estimate,
    straggler_probability,
)

SETTINGS = settings(max_examples=150, deadline=None)


def test_scaling_worked_example() -> None:
    pts = scaling([1, 2, 8], compute_s=1.0, comm_s=0.25, overlap=0.0, samples_per_rank=32)
    assert [p.step_s for p in pts] == [1.0, 1.25, 1.25]
    assert pts[0].efficiency == 1.0 and pts[2].efficiency == pytest.approx(0.8)
    assert pts[2].throughput == pytest.approx(8 * 32 / 1.25)
    full = scaling([8], 1.0, 0.25, overlap=1.0)[0]
    assert full.efficiency == 1.0 and full.exposed_comm_s == 0.0
    capped = scaling([8], 0.1, 0.25, overlap=1.0)[0]  # cannot hide more than the compute
    assert capped.exposed_comm_s == pytest.approx(0.15)


@SETTINGS
@given(
    degrees=st.lists(st.integers(1, 4096), min_size=1, max_size=10),
    compute=st.floats(1e-4, 10.0), overlap=st.floats(0.0, 1.0), grad_gb=st.floats(0.001, 100.0),
)
def test_scaling_properties(degrees: list[int], compute: float, overlap: float, grad_gb: float) -> None:
    comm = allreduce_comm(grad_gb * 1e9, LINKS["ib-ndr-400"])
    for p in scaling(degrees, compute, comm, overlap):
        assert 0 < p.efficiency <= 1.0 + 1e-12
        assert p.step_s >= compute
        assert p.speedup == pytest.approx(p.efficiency * p.dp)
        assert p.comm_s == (0.0 if p.dp == 1 else pytest.approx(comm(p.dp)))
    more = scaling([8], compute, comm, min(1.0, overlap + 0.1))[0]
    assert more.step_s <= scaling([8], compute, comm, overlap)[0].step_s + 1e-12


def test_straggler_probability() -> None:
    assert straggler_probability(0.01, 1) == pytest.approx(0.01)
    assert straggler_probability(0.01, 8) == pytest.approx(1 - 0.99**8)
    assert straggler_probability(0.01, 512) == pytest.approx(0.9942, abs=1e-4)
    assert straggler_probability(0.0, 10**6) == 0.0 and straggler_probability(1.0, 3) == 1.0
    assert straggler_probability(1e-12, 10**6) == pytest.approx(1e-6, rel=1e-5)  # precise for tiny p
    with pytest.raises(ConfigError):
        straggler_probability(1.5, 2)


@SETTINGS
@given(p=st.floats(0.0, 1.0), n=st.integers(1, 10**5))
def test_straggler_monotone(p: float, n: int) -> None:
    a, b = straggler_probability(p, n), straggler_probability(p, n + 1)
    assert 0.0 <= a <= b <= 1.0
    assert a == pytest.approx(1 - (1 - p) ** n, abs=1e-9)


def test_expected_step_time() -> None:
    assert expected_step_time(1.0, 64, 0.01, 0.5) == pytest.approx(1 + 0.5 * (1 - 0.99**64))
    est = straggler_estimate(1.0, 512, 0.01, 0.5)
    assert est.efficiency == pytest.approx(1.0 / est.expected_step_s)
    assert step_time([1.0, 1.2, 0.9]) == 1.2
    with pytest.raises(ConfigError):
        step_time([])


def test_hierarchical_beats_flat_ring_across_nodes() -> None:
    h = hierarchical_allreduce_time(2e9, 8, 8, LINKS["nvlink4-h100"], LINKS["ib-ndr-400"])
    assert h.total_s == pytest.approx(h.intra_reduce_scatter_s + h.inter_all_reduce_s + h.intra_all_gather_s)
    assert h.total_s < h.flat_ring_s and h.speedup > 1
    # Inter-node phase moves only S/g per GPU.
    assert h.inter_all_reduce_s == pytest.approx(ring_allreduce_time(2e9 / 8, 8, LINKS["ib-ndr-400"]))


@SETTINGS
@given(size=st.floats(1e3, 1e11), nodes=st.integers(1, 64), g=st.integers(1, 16))
def test_hierarchical_degenerate_cases(size: float, nodes: int, g: int) -> None:
    intra, inter = Link("nv", 450e9), Link("ib", 50e9)
    h = hierarchical_allreduce_time(size, nodes, g, intra, inter)
    if nodes == 1:
        # One node: RS + AG on the fast link is exactly a ring all-reduce there.
        assert h.total_s == pytest.approx(ring_allreduce_time(size, g, intra))
    if g == 1:
        assert h.total_s == pytest.approx(ring_allreduce_time(size, nodes, inter))
    assert h.total_s <= h.flat_ring_s * (1 + 1e-9) or math.isclose(h.total_s, h.flat_ring_s)


def test_scaling_validation() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        scaling([1], 1.0, 0.1, overlap=1.5)
    with pytest.raises(ConfigError, match="compute_s"):
        scaling([1], 0.0, 0.1)
    with pytest.raises(ConfigError, match="DP degrees"):
        scaling([0], 1.0, 0.1)


def test_shared_nic_gives_the_flat_ring_the_whole_link() -> None:
    # 2 hosts × 2 ranks behind one 125 MB/s link each: every rank's share is
    # 62.5 MB/s while both send (the two-level inter phase), but the flat
    # ring's one crossing stream per host gets the whole 125 MB/s
    intra, share = Link("loop", 1e9), Link("eth-share", 62.5e6)
    per_rank = hierarchical_allreduce_time(64 * 2**20, 2, 2, intra, share)
    shared = hierarchical_allreduce_time(64 * 2**20, 2, 2, intra, share, shared_nic=True)
    assert shared.total_s == pytest.approx(per_rank.total_s)
    assert shared.flat_ring_s == pytest.approx(ring_allreduce_time(64 * 2**20, 4, Link("eth", 125e6)))
    assert per_rank.flat_ring_s == pytest.approx(2 * shared.flat_ring_s, rel=0.01)
