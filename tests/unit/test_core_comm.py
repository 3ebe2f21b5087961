"""Collective cost: published figures, nccl-tests bandwidths, ZeRO step volume."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import (
    GB,
    LINKS,
    ConfigError,
    Link,
    algbw,
    bus_factor,
    busbw,
    collective_bytes,
    collective_time,
    step_volume,
)
from dpnb.core.comm import COLLECTIVES

SETTINGS = settings(max_examples=150, deadline=None)
sizes = st.floats(1.0, 1e12)
ranks = st.integers(2, 4096)


def test_1b_fp16_on_8_gpus() -> None:
    size = 1e9 * 2  # 1B params × 2 bytes
    assert collective_bytes("all_reduce", size, 8) == pytest.approx(3.5 * GB)
    t200 = collective_time("all_reduce", size, 8, LINKS["ib-hdr-200"])
    t400 = collective_time("all_reduce", size, 8, LINKS["ib-ndr-400"])
    assert t200 >= 0.140  # "a minimum of 140 ms" at 25 GB/s
    assert t200 == pytest.approx(0.140, rel=1e-2)
    assert t400 == pytest.approx(0.070, rel=1e-2)  # "halves this to 70 ms" at 50 GB/s
    assert collective_time("all_reduce", size, 8, Link("ideal", 25e9)) == pytest.approx(0.140)


def test_7b_fp16_gradients_about_28gb_per_step() -> None:
    vol = step_volume(7e9, 2, 8, 0)
    assert vol.asymptotic == pytest.approx(28 * GB)  # 2 × 14 GB: the large-N figure quoted
    assert vol.total == pytest.approx(24.5 * GB)  # at N = 8 the ring factor is 2·7/8
    assert step_volume(7e9, 2, 1024, 0).total == pytest.approx(28 * GB, rel=1e-3)


@SETTINGS
@given(psi=st.integers(1, 10**12), b=st.sampled_from([1, 2, 4]), n=st.integers(1, 4096))
def test_zero_step_volume(psi: int, b: int, n: int) -> None:
    v = [step_volume(psi, b, n, s) for s in range(4)]
    ring = (n - 1) / n
    assert v[0].total == pytest.approx(2 * ring * psi * b)
    assert v[1].total == pytest.approx(v[0].total) and v[2].total == pytest.approx(v[0].total)
    assert v[3].total == pytest.approx(1.5 * v[0].total)  # 3Ψ vs 2Ψ
    assert v[0].asymptotic == 2 * psi * b and v[3].asymptotic == 3 * psi * b
    assert [p.collective for p in v[3].phases] == ["all_gather", "all_gather", "reduce_scatter"]


def test_link_presets_are_nominal_decimal() -> None:
    assert LINKS["ib-ndr-400"].bandwidth_Bps == 400e9 / 8
    assert LINKS["ib-hdr-200"].bandwidth_Bps == 200e9 / 8
    assert LINKS["nvlink4-h100"].bandwidth_Bps == 450e9
    assert LINKS["pcie-gen4-x16"].bandwidth_Bps == 25e9
    assert all(link.note for link in LINKS.values())


@SETTINGS
@given(size=sizes, n=ranks, t=st.floats(1e-6, 100.0))
def test_busbw_vs_algbw(size: float, n: int, t: float) -> None:
    assert busbw("all_reduce", size, t, n) >= algbw(size, t)
    assert busbw("broadcast", size, t, n) == algbw(size, t)
    # nccl-tests count the full N-rank buffer for reduce-scatter / all-gather.
    assert busbw("all_gather", size, t, n) <= algbw(size, t)
    assert busbw("reduce_scatter", size, t, n) == pytest.approx(busbw("all_gather", size, t, n))


@SETTINGS
@given(size=sizes, n=ranks, kind=st.sampled_from(COLLECTIVES), bw=st.floats(1e8, 1e12))
def test_busbw_recovers_link_bandwidth(size: float, n: int, kind: str, bw: float) -> None:
    # Without latency the modelled time's busbw is the link bandwidth, whatever N: the point of busbw.
    t = collective_time(kind, size, n, Link("x", bw))  # type: ignore[arg-type]
    assert busbw(kind, size, t, n) == pytest.approx(bw)  # type: ignore[arg-type]


@SETTINGS
@given(size=sizes, n=ranks)
def test_ring_identities(size: float, n: int) -> None:
    rs = collective_bytes("reduce_scatter", size, n)
    ag = collective_bytes("all_gather", size, n)
    assert collective_bytes("all_reduce", size, n) == pytest.approx(rs + ag)
    assert collective_bytes("all_reduce", size, n) < 2 * size
    assert collective_bytes("broadcast", size, n) == size
    assert bus_factor("all_reduce", n) >= 1.0


def test_latency_term_and_single_rank() -> None:
    link = Link("slow", 1e9, 1e-3)
    assert collective_time("all_reduce", 0, 4, link) == pytest.approx(6e-3)  # 2(N−1) steps
    assert collective_time("all_gather", 0, 4, link) == pytest.approx(3e-3)
    assert collective_time("all_reduce", 1e9, 1, link) == 0.0


def test_comm_validation() -> None:
    with pytest.raises(ConfigError, match="collective"):
        collective_bytes("all_to_all", 1.0, 2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="positive"):
        collective_bytes("all_reduce", 1.0, 0)
    with pytest.raises(ConfigError, match="bandwidth"):
        Link("bad", 0.0)
    with pytest.raises(ConfigError, match="time_s"):
        algbw(1.0, 0.0)
    with pytest.raises(ConfigError, match="stage"):
        step_volume(1e9, 2, 8, 5)
