"""dpnb.core.profile on synthetic traces: names, lanes, overlap, stragglers, clocks."""

import json

import pytest

from dpnb.core import profile as P
from dpnb.core.errors import ConfigError


@pytest.mark.parametrize("name,cat,kind,op", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", P.Kind.COMM, "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float", "kernel", P.Kind.COMM, "all_reduce"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "kernel", P.Kind.COMM, "reduce_scatter"),
    ("ncclDevKernel_AllGather_RING_LL", "kernel", P.Kind.COMM, "all_gather"),
    ("ncclDevKernel_SendRecv", "kernel", P.Kind.COMM, "send_recv"),
    ("ncclDevKernel_Broadcast_RING_LL", "kernel", P.Kind.COMM, "broadcast"),
    ("ampere_sgemm_128x64_nn", "kernel", P.Kind.COMPUTE, "other"),
    ("gloo:all_reduce", "user_annotation", P.Kind.COMM, "all_reduce"),
    ("gloo:barrier", "user_annotation", P.Kind.COMM, "barrier"),
    ("c10d::allreduce_", "cpu_op", P.Kind.ENQUEUE, "all_reduce"),
    ("c10d::_reduce_scatter_base_", "cpu_op", P.Kind.ENQUEUE, "reduce_scatter"),
    ("c10d::allgather_into_tensor_coalesced_", "cpu_op", P.Kind.ENQUEUE, "all_gather"),
    ("aten::mm", "cpu_op", P.Kind.COMPUTE, "other"),
    ("DistributedDataParallel.forward", "user_annotation", P.Kind.OTHER, "other"),
])
def test_every_name_nccl_and_gloo_use(name, cat, kind, op):
    assert P.classify(name, cat) is kind
    assert P.op_of(name) == op


def _x(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 0,
            "args": args}


def _gpu_rank(arrive):
    """Three compute kernels 0-300 µs; one all-reduce kernel from ``arrive`` to 350."""
    return [_x(P.CLOCK_MARKER, 0, 1, cat="user_annotation"),
            _x("sm80_xmma_gemm", 0, 100, cat="kernel", tid=7),
            _x("sm80_xmma_gemm", 100, 100, cat="kernel", tid=7),
            _x("sm80_xmma_gemm", 200, 100, cat="kernel", tid=7),
            _x("aten::mm", 0, 20),  # the CPU's launch: not GPU work
            _x("c10d::allreduce_", 10, 5),
            _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", arrive, 350 - arrive, cat="kernel", tid=8),
            _x(P.END_MARKER, 400, 1, cat="user_annotation")]


def test_gpu_lanes_overlap_and_exposed_comm():
    r0 = P.extract(_gpu_rank(150), rank=0, host="a")
    r1 = P.extract(_gpu_rank(250), rank=1, host="a")
    assert r0.device == "cuda" and r0.compute == ((0.0, 300.0),)
    assert [c.arrive_us for c in r1.comm] == [250.0]  # the kernel's start, not the launch
    rep = P.analyze([r1, r0], world_size=2)
    s0, s1 = rep.stats
    assert s0.comm_s == pytest.approx(200e-6) and s0.overlapped_s == pytest.approx(150e-6)
    assert s0.exposed_s == pytest.approx(50e-6) and s0.overlap_pct == pytest.approx(75.0)
    assert s0.idle_s == pytest.approx(50e-6)  # 350-400 µs: neither
    assert rep.straggler.rank == 1 and rep.straggler.typical_late_s == pytest.approx(100e-6)
    assert rep.skew_s is None and "one host" in rep.clock_note


def _cpu_rank(arrive_ms, host="h", shift_us=0.0, size=65792, end_us=60_000, marker_us=1):
    """Forward/backward ops on the main thread, one all-reduce on gloo's thread."""
    a = arrive_ms * 1000 + shift_us
    return [_x(P.CLOCK_MARKER, shift_us, marker_us, cat="user_annotation"),
            _x("aten::addmm", shift_us + 100, 900),
            _x("c10d::allreduce_", a, 50),
            _x("gloo:all_reduce", a + 20, end_us + shift_us - a, cat="user_annotation", tid=2,
               **{"Input Dims": [[size]], "Input type": ["float"]}),
            _x("aten::add_", end_us + 1000 + shift_us, 500),
            _x(P.END_MARKER, end_us + 2000 + shift_us, 1, cat="user_annotation")]


def test_cpu_straggler_named_with_its_lateness():
    ranks = [P.extract(_cpu_rank(ms), rank=i, host="h") for i, ms in enumerate((1, 51, 2))]
    rep = P.analyze(ranks, world_size=3)
    assert rep.straggler.rank == 1 and rep.straggler.typical_late_s == pytest.approx(0.050)
    (col,) = rep.collectives
    assert col.nbytes == 65792 * 4 and col.last_rank == 1
    (row,) = rep.ops
    assert row.op == "all_reduce" and row.count == 1
    # transfer: from the last entry (rank 1's, 51 000 µs) to the ends (60 020 µs); bus
    # bandwidth as nccl-tests defines it for an all-reduce: bytes / time x 2(n-1)/n
    assert row.transfer_s == pytest.approx((60_020 - 51_000) * 1e-6)
    assert row.busbw_Bps == pytest.approx(65792 * 4 / ((60_020 - 51_000) * 1e-6) * 2 * 2 / 3)
    # gloo's span is communication, the thread's ops compute
    assert rep.stats[0].compute_s == pytest.approx((900 + 500) * 1e-6)


def test_a_subset_profile_names_the_late_rank_by_its_rank_not_its_position():
    """Profiling ranks 1 and 2 of 3 (``--ranks 1,2``): rank 2, the second trace,
    is late; the report says rank 2 (position 1 would read as rank 1)."""
    ranks = [P.extract(_cpu_rank(ms), rank=r, host="h") for r, ms in ((2, 31), (1, 1))]
    rep = P.analyze(ranks, world_size=3)
    assert [r.rank for r in rep.ranks] == [1, 2] and [s.rank for s in rep.stats] == [1, 2]
    assert rep.world_size == 3
    assert rep.straggler.rank == 2 and rep.straggler.typical_late_s == pytest.approx(0.030)
    assert (rep.straggler.last_at, rep.straggler.of) == (1, 1)


def test_several_hosts_are_aligned_on_their_collectives():
    # rank 1's host clock runs 70 ms ahead; its wall clock says 3 ms (NTP off by 67 ms):
    # rank 1 would leave the 59 ms all-reduce before rank 0 entered it
    r0 = P.extract(_cpu_rank(1, host="a"), rank=0, host="a", wall_offset_us=1e9)
    r1 = P.extract(_cpu_rank(1, host="b", shift_us=70_000), rank=1, host="b",
                   wall_offset_us=1e9 - 3_000)
    rep = P.analyze([r0, r1], world_size=2)
    assert rep.skew_s == pytest.approx(0.0, abs=1e-9) and "ranks [1] shifted" in rep.clock_note
    assert rep.collectives[0].lateness_s == pytest.approx(0.0, abs=1e-6)


def test_wall_clocks_no_collective_contradicts_are_kept_over_late_closed_spans():
    """Two hosts, one true clock: rank 1 enters 100 ms late and, with compute waiting
    right after, closes its span 40 ms after rank 0's (seen on two busy cores).
    Aligning on the ends would take 40 ms off its lateness; the wall clocks agree
    with the collective (nobody left before the other entered), so they stay."""
    r0 = P.extract(_cpu_rank(1, host="a", end_us=101_020), rank=0, host="a", wall_offset_us=1e9)
    r1 = P.extract(_cpu_rank(101, host="b", end_us=141_020), rank=1, host="b",
                   wall_offset_us=1e9)
    rep = P.analyze([r0, r1], world_size=2)
    assert "agrees with the wall clocks" in rep.clock_note, rep.clock_note
    assert rep.offsets_s[0] == rep.offsets_s[1]
    assert rep.straggler.rank == 1 and rep.straggler.typical_late_s == pytest.approx(0.100)


@pytest.mark.parametrize("wall_off_us,marker_us", [(500, 1), (2500, 6000)],
                         ids=["off-by-less-than-ntp", "off-within-a-long-marker-read"])
def test_a_wall_clock_off_by_less_than_its_precision_is_moved_the_least(wall_off_us, marker_us):
    """As above (rank 1 100 ms late, its span closed 40 ms late), but rank 1's wall
    clock reads ``wall_off_us`` late: rank 1 seems to enter after rank 0 left.
    Within the clocks' precision -- 1 ms (NTP) plus half of each rank's marker
    span, inside which it read the wall clock (6 ms on a busy CPU) -- the least
    shift that makes the collective causal is taken, not the late-closed ends."""
    r0 = P.extract(_cpu_rank(1, host="a", end_us=101_020), rank=0, host="a", wall_offset_us=1e9)
    r1 = P.extract(_cpu_rank(101, host="b", end_us=141_020, marker_us=marker_us), rank=1,
                   host="b", wall_offset_us=1e9 + wall_off_us)
    rep = P.analyze([r0, r1], world_size=2)
    assert "ranks [1] moved the least" in rep.clock_note, rep.clock_note
    # rank 1's entry lands on rank 0's end: ~100 ms after rank 0's entry (the ends
    # would have made it 60)
    assert rep.straggler.rank == 1
    assert rep.straggler.typical_late_s == pytest.approx(0.100, abs=1e-4)


def _checked_rank(check_ms: tuple[float, float]):
    """A checked all-reduce: dpnb's check on the main thread (where a rank waits
    for the late one), then the c10d call and gloo's span, alike on every rank."""
    c0, c1 = (x * 1000 for x in check_ms)
    return [_x(P.CLOCK_MARKER, 0, 1, cat="user_annotation"),
            _x("aten::ones", 100, 50),
            _x(f"{P.CHECK_MARKER} all_reduce", c0, c1 - c0, cat="user_annotation"),
            _x("c10d::allreduce_", 201_100, 30),
            _x("gloo:all_reduce", 201_150, 300, cat="user_annotation", tid=2,
               **{"Input Dims": [[4]], "Input type": ["float"]}),
            _x(P.END_MARKER, 202_000, 1, cat="user_annotation")]


def test_a_checked_collective_is_entered_where_its_check_began():
    """Rank 1 calls the all_reduce 200 ms late; in a checked cell rank 0 waits in
    dpnb's check, so both c10d calls start together.  The entry is the check's
    start: rank 1 is the straggler, 200 ms late, and rank 0's wait is its
    exposed communication, not compute and not idle."""
    r0 = P.extract(_checked_rank((1, 201)), rank=0, host="h")
    r1 = P.extract(_checked_rank((201, 201.05)), rank=1, host="h")
    rep = P.analyze([r0, r1], world_size=2)
    assert rep.straggler.rank == 1 and rep.straggler.typical_late_s == pytest.approx(0.200)
    s0 = rep.stats[0]
    assert s0.compute_s == pytest.approx(50e-6) and s0.exposed_s == pytest.approx(0.20045)


def test_the_merged_trace_is_chrome_json_with_one_process_per_rank():
    evs = {0: _cpu_rank(1), 1: _cpu_rank(3)}
    ranks = [P.extract(e, rank=r, host="h", wall_offset_us=5e6) for r, e in evs.items()]
    rep = P.analyze(ranks, world_size=2)
    merged = json.loads(json.dumps(P.merged_trace(rep, {r: {"traceEvents": e} for r, e in evs.items()})))
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"rank 0 (h)", "rank 1 (h)"}
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert min(e["ts"] for e in merged["traceEvents"] if "ts" in e) == pytest.approx(0.0)


def test_caps_and_bad_input_say_so():
    many = [_x("aten::add", 10 * i, 5) for i in range(P.MAX_COMPUTE_INTERVALS + 7)]
    r = P.extract(many, rank=0, host="h")
    assert r.dropped == 7 and len(r.compute) == P.MAX_COMPUTE_INTERVALS
    rep = P.analyze([r], world_size=1)
    assert any("left out" in n for n in rep.notes)
    with pytest.raises(ConfigError, match="no rank sent a profile"):
        P.analyze([], world_size=2)


def test_mismatched_collective_counts_are_noted_not_guessed():
    a = _cpu_rank(1)
    b = _cpu_rank(2) + [_x("gloo:all_reduce", 61_500, 10, cat="user_annotation", tid=2)]
    rep = P.analyze([P.extract(a, rank=0, host="h"), P.extract(b, rank=1, host="h")], 2)
    assert len(rep.collectives) == 1
    assert any("ran 1, 2 of them" in n for n in rep.notes)


def test_time_inside_a_c10d_call_is_not_compute_even_under_a_parent_op():
    # autograd's AccumulateGrad hook spans DDP's enqueue, which blocks 3 ms
    ev = [_x("autograd::engine::evaluate_function: AccumulateGrad", 0, 4000),
          _x("c10d::allreduce_", 500, 3000),
          _x("gloo:all_reduce", 520, 2900, cat="user_annotation", tid=2)]
    r = P.extract(ev, rank=0, host="h")
    assert r.compute == ((0.0, 500.0), (3500.0, 4000.0))
    assert P.subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]
    assert P.subtract([(0, 10)], []) == [(0, 10)] and P.subtract([], [(0, 1)]) == []


def test_a_span_closed_late_is_cut_at_the_first_finisher_plus_one_ring_step():
    a = _cpu_rank(1)  # entered at 1 000 µs, its all-reduce span ends at 60 020 µs
    b = [dict(e) for e in _cpu_rank(1)]
    b[3]["dur"] += 40_000  # gloo's thread closed its span 40 ms late
    rep = P.analyze([P.extract(a, rank=0, host="h"), P.extract(b, rank=1, host="h")], 2)
    ends = [c.end_us for r in rep.ranks for c in r.comm]
    step = (60_020 - 1000) / P.collective_steps("all_reduce", 2)  # from the last entry
    assert ends[0] == pytest.approx(60_020) and ends[1] == pytest.approx(60_020 + step)
    assert any("were cut there" in n for n in rep.notes)


def test_gloo_runs_a_reduce_scatter_as_an_all_reduce_and_the_call_names_it():
    ev = [_x("c10d::_allgather_base_", 0, 10), _x("c10d::_reduce_scatter_base_", 100, 10),
          _x("gloo:all_gather", 5, 50, cat="user_annotation", tid=2),
          _x("gloo:all_reduce", 105, 50, cat="user_annotation", tid=2,
             **{"Input Dims": [[128]], "Input type": ["float"]})]
    r = P.extract(ev, rank=0, host="h")
    assert [(c.op, c.name, c.arrive_us) for c in r.comm] == [
        ("all_gather", "gloo:all_gather", 0.0), ("reduce_scatter", "gloo:all_reduce", 100.0)]
    assert r.comm[1].nbytes == 512


def test_the_typical_lateness_is_not_hidden_by_a_tiny_collective():
    def rank(late_ms, bcast_at):
        ev = [_x("c10d::broadcast_", bcast_at, 5),
              _x("gloo:broadcast", bcast_at + 1, 20, cat="user_annotation", tid=2)]
        for k in range(2):
            a = 10_000 + k * 100_000 + late_ms * 1000
            ev += [_x("c10d::allreduce_", a, 5),
                   _x("gloo:all_reduce", a + 1, 10_000 + k * 100_000 + 51_000 - a,
                      cat="user_annotation", tid=2)]
        return ev
    # rank 0 enters the broadcast last (by 1 ms); rank 1 is 50 ms late to both all-reduces
    r = [P.extract(rank(0, 1000), rank=0, host="h"), P.extract(rank(50, 0), rank=1, host="h")]
    st = P.analyze(r, 2).straggler
    assert st.rank == 1 and (st.last_at, st.of) == (2, 3)
    assert st.typical_late_s == pytest.approx(0.050) and st.max_late_s == pytest.approx(0.050)


def test_nccl_kernels_are_named_by_the_c10d_call_that_launched_them():
    """FSDP2's and coalesced launches run ``ncclDevKernel_Generic``: the name
    says nothing of the op.  The kernel's External id (or its correlation to
    the runtime launch inside the call) leads to the c10d event that names it."""
    ev = [_x(P.CLOCK_MARKER, 0, 1, cat="user_annotation"),
          # linked by External id: record_param_comms names the collective
          _x("record_param_comms", 10, 8, **{"External id": 5,
                                              "Collective name": "_reduce_scatter_base"}),
          _x("cudaLaunchKernel", 12, 2, cat="cuda_runtime", correlation=11, **{"External id": 5}),
          _x("ncclDevKernel_Generic_4", 40, 30, cat="kernel", tid=8, correlation=11,
             **{"External id": 5}),
          # linked by correlation only: the launch sits inside nccl:_allgather_base
          _x("nccl:_allgather_base", 100, 10),
          _x("cudaLaunchKernel", 104, 2, cat="cuda_runtime", correlation=12),
          _x("ncclDevKernel_Generic_4", 120, 30, cat="kernel", tid=8, correlation=12),
          # neither: the kernel's own name is all there is
          _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 10, cat="kernel", tid=8),
          _x(P.END_MARKER, 400, 1, cat="user_annotation")]
    r = P.extract(ev, rank=0, host="a")
    assert [c.op for c in r.comm] == ["reduce_scatter", "all_gather", "all_reduce"]
    assert P.op_of("nccl:coalesced") == "coalesced"  # a grouped launch still pairs by name
