"""DDP bucketing against torch's own assignment and real DDP, plus the overlap timeline."""

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    LINKS,
    ConfigError,
    Link,
    MiB,
    assign_buckets,
    collective_time,
    ddp_bucket_caps,
    ddp_buckets,
    initial_ddp_buckets,
    overlap_timeline,
    proportional_backward,
    rebuild_buckets,
)

SETTINGS = settings(max_examples=100, deadline=None)
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

numels = st.lists(st.integers(0, 3 * 2**18), min_size=1, max_size=30)  # up to 3 MiB of fp32 each


def _tensors(n: list[int]) -> list[Any]:
    return [torch.empty(k, dtype=torch.float32) for k in n]


def test_defaults_match_torch() -> None:
    assert DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES == 1 * MiB
    assert DEFAULT_BUCKET_CAP_BYTES == 25 * MiB
    cfg = getattr(torch.nn.parallel.distributed, "_BucketCapacityConfig", None)
    if cfg is not None:
        for mb in (None, 25, 4, 0.5):
            c = cfg.create(mb, None, False)
            assert ddp_bucket_caps(mb) == (c.first_bucket_bytes_cap, c.bucket_bytes_cap)


@SETTINGS
@given(n=numels, cap_mib=st.sampled_from([1, 2, 5, 25]), first_kib=st.sampled_from([256, 1024, 4096]), data=st.data())
def test_rebuild_matches_torch_assignment(n: list[int], cap_mib: int, first_kib: int, data: st.DataObject) -> None:
    order = data.draw(st.permutations(list(range(len(n)))))
    cap, first = cap_mib * MiB, first_kib * 1024
    ts = _tensors(n)
    ref, ref_limits = dist._compute_bucket_assignment_by_size([ts[i] for i in order], [first, cap], [], list(order))
    ours = rebuild_buckets([4 * k for k in n], order, cap, first)
    assert [list(b.param_indices) for b in ours] == [list(b) for b in ref]
    assert [b.cap for b in ours] == list(ref_limits)


@SETTINGS
@given(n=numels, cap_mib=st.sampled_from([1, 3, 25]), find_unused=st.booleans())
def test_initial_buckets_match_ddp_construction(n: list[int], cap_mib: int, find_unused: bool) -> None:
    cap, first = cap_mib * MiB, DEFAULT_FIRST_BUCKET_BYTES
    limits = [first, cap] if (find_unused and first < cap) else ([cap] if find_unused else [2**63 - 1])
    ref, _ = dist._compute_bucket_assignment_by_size(_tensors(n), limits, [])
    ours = initial_ddp_buckets([4 * k for k in n], cap, first, find_unused_parameters=find_unused)
    assert [list(b.param_indices) for b in ours] == [list(b) for b in reversed(ref)]


@SETTINGS
@given(n=numels, dt=st.lists(st.sampled_from(["float32", "bfloat16"]), min_size=30, max_size=30))
def test_per_dtype_buckets_match_torch(n: list[int], dt: list[str]) -> None:
    dtypes = dt[: len(n)]
    ts = [torch.empty(k, dtype=getattr(torch, d)) for k, d in zip(n, dtypes)]
    order = list(reversed(range(len(n))))
    ref, _ = dist._compute_bucket_assignment_by_size([ts[i] for i in order], [MiB, 2 * MiB], [], order)
    sizes = [t.numel() * t.element_size() for t in ts]
    ours = ddp_buckets(sizes, 2 * MiB, MiB, dtypes=dtypes)
    # Leftover buckets come from an unordered map in C++: compare as a set.
    assert sorted(b.param_indices for b in ours) == sorted(tuple(b) for b in ref)


def test_rebuilt_buckets_match_real_ddp(engine_measurements: dict[str, Any]) -> None:
    for r in engine_measurements["ddp_rebuilds"]:
        first, cap = ddp_bucket_caps(r["bucket_cap_mb"])
        ours = ddp_buckets(r["param_bytes"], cap, first)
        assert [list(b.param_indices) for b in ours] == r["buckets"]
        assert [b.nbytes for b in ours] == r["sizes"]
    assert any(len(r["buckets"]) > 1 for r in engine_measurements["ddp_rebuilds"])


def test_worked_example() -> None:
    buckets = ddp_buckets([4 * MiB] * 10)  # ten 4 MiB gradients, default caps
    assert [b.param_indices for b in buckets] == [(9,), (8, 7, 6, 5, 4, 3, 2), (1, 0)]
    assert [b.nbytes for b in buckets] == [4 * MiB, 28 * MiB, 8 * MiB]  # a bucket may overshoot its cap
    assert [b.cap for b in buckets] == [MiB, 25 * MiB, 25 * MiB]
    assert len(initial_ddp_buckets([4 * MiB] * 10)) == 1  # before the first rebuild


@SETTINGS
@given(sizes=st.lists(st.integers(0, 40 * MiB), min_size=1, max_size=50), cap=st.integers(1, 64 * MiB))
def test_bucket_invariants(sizes: list[int], cap: int) -> None:
    buckets = ddp_buckets(sizes, cap, min(cap, MiB))
    assert sorted(i for b in buckets for i in b.param_indices) == list(range(len(sizes)))
    for b in buckets[:-1]:
        assert b.nbytes >= b.cap  # closed because it reached its cap ...
        assert b.nbytes - sizes[b.param_indices[-1]] < b.cap  # ... only with its last parameter
    assert sum(b.nbytes for b in buckets) == sum(sizes)


def test_bucketing_validation() -> None:
    with pytest.raises(ConfigError, match="permutation"):
        rebuild_buckets([1, 2, 3], [0, 1])
    with pytest.raises(ConfigError, match="non-negative"):
        ddp_buckets([1, -2])
    with pytest.raises(ConfigError, match="limits"):
        assign_buckets([1], [0], [])
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        ddp_bucket_caps(0)


link_st = st.builds(Link, st.just("l"), st.floats(1e8, 1e12), st.floats(0.0, 1e-4))


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 10**9), min_size=1, max_size=20),
    back=st.floats(0.0, 0.5), link=link_st, n=st.integers(1, 64),
)
def test_timeline_invariants(sizes: list[int], back: float, link: Link, n: int) -> None:
    t = overlap_timeline(sizes, proportional_backward(sizes, back), link, n)
    comm_total = sum(collective_time("all_reduce", s, n, link) for s in sizes)
    assert t.comm_s == pytest.approx(comm_total)
    assert t.overlapped_s <= t.sequential_s * (1 + 1e-12)
    assert t.overlapped_s >= max(t.compute_s, t.comm_s) * (1 - 1e-12)
    assert 0 <= t.exposed_comm_s <= t.comm_s * (1 + 1e-12) + 1e-15
    for c, m in zip(t.compute, t.comm):
        assert m.start >= c.end
    for a, b in zip(t.comm, t.comm[1:]):
        assert b.start >= a.end - 1e-15


def test_timeline_worked_example() -> None:
    # Four equal buckets, 10 ms backward each, 5 ms all-reduce each: all but the last hides.
    link = Link("l", 2 * 1e8 * 3 / 4 / 5e-3)  # 1e8-byte bucket, N=4 → 1.5e8 bytes in 5 ms
    t = overlap_timeline([10**8] * 4, 0.010, link, 4)
    assert t.compute_s == pytest.approx(0.040)
    assert t.sequential_s == pytest.approx(0.060)
    assert t.overlapped_s == pytest.approx(0.045)
    assert t.exposed_comm_s == pytest.approx(0.005)
    assert t.overlap_fraction == pytest.approx(0.75)
    slow = overlap_timeline([10**8] * 4, 0.001, LINKS["gloo-loopback"], 4)
    assert slow.exposed_comm_s > 0.5 * slow.comm_s  # communication-bound: little to hide behind
    with pytest.raises(ConfigError, match="one per bucket"):
        overlap_timeline([1, 2], [0.1], link, 2)
