"""Gradient-sync view: timeline segments, bucket table, the model beside the measurement."""

import pytest

from dpnb.core import LINKS, collective_bytes, ddp_bucket_caps, ddp_buckets, overlap_timeline
from dpnb.widgets import gradsync
from helpers.recorded import CAP_MB, PARAMS, ddp_record, records32

def records():
    return [ddp_record(0), ddp_record(1, shift=0.0002)]


def test_segments_per_lane_and_overlap_numbers():
    d = gradsync.data(records())
    r0 = d.ranks[0]
    assert len(r0.lane("forward")) == 1
    assert len(r0.lane("backward")) == 3
    assert len(r0.lane("all_reduce")) == 2  # one per bucket ...
    assert len(r0.lane("all_reduce", queued=True)) == 3  # ... plus bucket 1 waiting behind bucket 0
    assert len(r0.lane("optimizer")) == 1 and r0.optimizer_timed
    assert r0.comm_s == pytest.approx(0.0071 - 0.0045)
    assert r0.exposed_s == pytest.approx(0.0071 - 0.005)
    assert r0.hidden_s == pytest.approx(0.0005)
    assert d.step == 5 and d.world_size == 2


def test_bucket_table():
    d = gradsync.data(records())
    assert [(b.index, b.n_params, b.bytes, b.ready_order) for b in d.buckets] == [(0, 4, 10100, 0), (1, 2, 4040, 1)]
    assert d.buckets[0].ready_s == pytest.approx(0.004) and d.buckets[1].ready_s == pytest.approx(0.005)
    txt = gradsync.text(d)
    assert "10,100" in txt and "ready order" in txt


def test_model_uses_core_buckets_and_says_where_it_disagrees():
    d = gradsync.data(records())
    order = [5, 4, 3, 2, 1, 0]
    first, cap = ddp_bucket_caps(CAP_MB)
    ref = ddp_buckets(list(PARAMS.values()), cap, first, order=order)
    assert d.predicted.bucket_bytes == tuple(b.nbytes for b in ref) == (10100, 4040)
    # link fitted: β = bytes sent per rank / serialized all-reduce time (two sizes → α = 0)
    busy = (0.0061 - 0.0045) + (0.0071 - 0.0061)
    beta = sum(collective_bytes("all_reduce", b, 2) for b in (10100, 4040)) / busy
    assert d.link.bandwidth_Bps == pytest.approx(beta) and d.link.latency_s == 0
    tl = overlap_timeline([10100, 4040], [0.003, 0.001], d.link, 2)
    assert d.predicted.timeline.exposed_comm_s == pytest.approx(tl.exposed_comm_s)
    line = [c for c in d.comparison if c.startswith("exposed communication")][0]
    diff = d.ranks[0].exposed_s - tl.exposed_comm_s
    assert "under-predicts" in line and f"by {diff * 1e3:.3g} ms" in line
    assert "buckets: measured 2, model 2 (same sizes)" in d.comparison
    assert any(c.startswith("total all-reduce time") and "agree" in c for c in d.comparison)


def test_other_cap_and_preset_link():
    d = gradsync.data(records(), cap_mb=1.0, link="ib-ndr-400")
    assert d.link is LINKS["ib-ndr-400"]
    assert d.other.bucket_bytes == (sum(PARAMS.values()),)  # everything fits one 1 MiB bucket
    assert any(c.startswith("at 1 MiB: 1 bucket, exposed") for c in d.comparison)


def test_figure_segments_labels_and_model_lanes():
    d = gradsync.data(records(), cap_mb=1.0)
    fig = gradsync.figure(d)
    ax, ax2 = fig.axes[:2]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:4] == ["rank 0 forward", "rank 0 backward", "rank 0 all-reduce", "rank 0 optimizer"]
    segs = gradsync.C.broken_barh_segments(ax)
    # per rank: forward 1, backward 3, all-reduce 2, optimizer 1, queued 1 → 8 per rank
    assert sorted(len(s) for s in segs) == sorted([1, 3, 2, 1, 1] * 2)
    ar = [s for s in segs if len(s) == 2][0]
    assert ar[0] == pytest.approx((4.5, 1.6)) and ar[1] == pytest.approx((6.1, 1.0))
    model = gradsync.C.broken_barh_segments(ax2)
    assert [len(s) for s in model] == [2, 2, 1, 1]  # measured cap: 2 buckets; 1 MiB: 1 bucket
    assert "ms" in ax2.get_xlabel()
    assert [t.get_text() for t in ax2.get_yticklabels()][3] == "1 bucket all-reduce"


def test_fsdp_records():
    rec = ddp_record(0)
    rec.update(strategy="zero3", buckets=[], backward=None, bucket_cap_mb=None, optimizer={"start": 0.008, "end": 0.0085},
               forward=[{"start": 0.0, "end": 0.003}],
               collectives=[{"kind": "all_gather", "bytes": 100, "phase": "forward", "unit": "0", "start": 0.0005, "end": 0.001},
                            {"kind": "all_gather", "bytes": 100, "phase": "backward", "unit": "0", "start": 0.004, "end": 0.0045},
                            {"kind": "reduce_scatter", "bytes": 100, "phase": "backward", "unit": "0", "start": 0.006, "end": 0.007}])
    d = gradsync.data([rec])
    r = d.ranks[0]
    assert len(r.lane("all_gather")) == 2 and len(r.lane("reduce_scatter")) == 1
    assert r.lane("backward")[0].start == 0.003 and r.lane("backward")[0].end == 0.008
    assert d.predicted is None and any("no DDP buckets" in n for n in d.notes)
    assert len(d.collectives) == 3 and "reduce_scatter" in gradsync.text(d)
    fig = gradsync.figure(d)
    assert "rank 0 reduce-scatter" in [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_errors_say_what_to_do():
    with pytest.raises(gradsync.C.ViewError, match="no recorded steps: run %dp train"):
        gradsync.data([])
    with pytest.raises(gradsync.C.ViewError, match="step 9 was not recorded"):
        gradsync.data(records(), step=9)


def test_unwatched_step_notes_it():
    recs = records()
    for r in recs:
        r["optimizer"] = None
        r["forward"] = []
    d = gradsync.data(recs)
    assert not d.ranks[0].optimizer_timed
    opt = d.ranks[0].lane("optimizer")[0]
    assert (opt.start, opt.end) == (0.0072, 0.009)
    assert any("--watch" in n for n in d.notes)


def test_widget_cap_slider():
    box = gradsync.view(records=records(), cap_mb=1.0)
    assert len(box.data.other.bucket_bytes) == 1
    box.controls["cap_mb"].value = 0.001  # ~1 KiB: a bucket per big parameter
    assert len(box.data.other.bucket_bytes) > 2
    box.controls["link"].value = "nvlink4-h100"
    assert box.data.link.name == "nvlink4-h100"
    assert "Buckets" in box.readout.value


def test_first_iteration_is_compared_with_construction_time_buckets():
    """DDP's first iteration uses one bucket (per dtype); only later does it
    rebuild in ready order.  A step flagged initial is predicted that way."""
    recs = []
    for rank in (0, 1):
        r = ddp_record(rank)
        r["initial_buckets"] = True
        r["buckets"] = [{"index": 0, "numel": 3535, "bytes": 14140, "params": list(PARAMS),
                         "start": 0.0051, "end": 0.0075}]
        recs.append(r)
    d = gradsync.data(recs)
    assert d.predicted.bucket_bytes == (14140,)
    assert "buckets: measured 1, model 1 (same sizes)" in d.comparison
    later = gradsync.data(records())  # the rebuilt buckets of a later step
    assert later.predicted.bucket_bytes == (10100, 4040)


def test_32_ranks_draw_a_few_lanes_and_summarise_the_rest():
    d = gradsync.data(records32())
    shown = gradsync.shown_ranks(d)
    assert 0 in shown and "slowest" in shown[17] and len(shown) <= 4
    fig = gradsync.figure(d)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) <= 4 * 5 and any("rank 17 (slowest" in x for x in labels)
    out = gradsync.text(d)
    assert "all 32 ranks, min / median / max" in out and "slowest rank 17" in out
    assert sum(line.strip().startswith("rank ") for line in out.splitlines()) == len(shown)


def test_compressed_buckets_show_the_bytes_sent_and_skip_the_fit():
    recs = records()
    for r in recs:
        r["comm_hook"] = "bf16"
        for b in r["buckets"]:
            b["sent_bytes"] = b["bytes"] // 2
    d = gradsync.data(recs)
    assert d.compressed and d.comm_hook == "bf16"
    out = gradsync.text(d)
    assert "comm hook bf16: 7,070 of 14,140 gradient bytes sent (50%)" in out
    assert "sent" in gradsync.bucket_headers(d) and "5,050" in out
    # the α-β model is of plain all-reduces: no fit to compressed timings
    assert "no fit" in d.link_source and "over-predicts" not in out and "under-predicts" not in out
    assert "compressed buckets: measured" in out
    plain = gradsync.data(records())
    assert not plain.compressed and "sent" not in gradsync.bucket_headers(plain)
