"""What JupyterLab's gradient-sync and memory panels are given (dpnb/core/labviews.py):
a step's lanes of bars per rank and each rank's bytes beside the exact model, from the
records the engines return (helpers/recorded.py writes them out)."""

import json

import pytest

from dpnb.core import labviews as LV
from dpnb.widgets import gradsync, memory
from helpers.recorded import ddp_record, records32, snapshots32


def test_a_steps_lanes_and_overlap_numbers_are_the_gradsync_views():
    recs = [ddp_record(0), ddp_record(1, shift=0.0002)]
    p = LV.sync_panel(recs, 2)
    view = gradsync.data(recs)
    assert (p.step, p.strategy, p.world_size, p.more_ranks) == (5, "ddp", 2, 0)
    assert p.ranks == view.ranks  # the view's own timelines (a short lane is kept as it is)
    r0 = p.ranks[0]
    assert r0.exposed_s == pytest.approx(0.0021) and r0.hidden_s == pytest.approx(0.0005)
    # bucket 1 waited behind bucket 0: a queued bar, then its all-reduce
    assert [(b.label, b.queued) for b in r0.segments if b.lane == "all_reduce"] == [
        ("b0", False), ("b1 queued", True), ("b1", False)]
    assert json.loads(json.dumps(p.as_dict()))["ranks"][1]["rank"] == 1


def test_the_latest_step_every_rank_recorded_is_shown():
    later = dict(ddp_record(0), step=6)  # rank 1 has not recorded step 6
    p = LV.sync_panel([ddp_record(0), ddp_record(1), later], 2)
    assert p.step == 5
    assert LV.sync_panel([later], 2) is None


def test_many_ranks_show_the_first_and_count_the_rest():
    p = LV.sync_panel(records32(), 32)
    assert [r.rank for r in p.ranks] == list(range(LV.PANEL_RANKS))
    assert p.as_dict()["more_ranks"] == 32 - LV.PANEL_RANKS
    m = LV.memory_panel(snapshots32("zero2", leak_rank=3)).as_dict()
    assert len(m["ranks"]) == LV.PANEL_RANKS and m["more_ranks"] == 32 - LV.PANEL_RANKS


def test_a_lane_of_hundreds_of_modules_is_drawn_where_it_was_busy():
    rec = ddp_record(0)
    # 300 modules' backward intervals, in three busy stretches with gaps between
    ivs = [{"module": str(i), "start": 0.001 + i * 1e-5 + (i // 100) * 0.001,
            "end": 0.001 + (i + 1) * 1e-5 + (i // 100) * 0.001, "params": []} for i in range(300)]
    rec["backward"] = dict(rec["backward"], intervals=ivs, compute_end=ivs[-1]["end"])
    p = LV.sync_panel([rec, dict(rec, rank=1)], 2)
    bw = [b for b in p.ranks[0].segments if b.lane == "backward"]
    assert len(bw) == 3 and all("300 intervals" in b.label for b in bw)
    assert bw[0].start == pytest.approx(0.001) and bw[0].end == pytest.approx(0.002)
    assert len(json.dumps(p.as_dict())) < 20_000


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_memory_per_rank_is_the_memory_views_comparison(strategy):
    snaps = snapshots32(strategy, leak_rank=5)
    p = LV.memory_panel(snaps)
    live = memory.live_data(snaps)
    assert (p.strategy, p.world_size, p.phase) == (strategy, 32, "after_step")
    for got, r in zip(p.ranks, live.ranks):
        assert dict(zip(LV.MEMORY_PARTS, got.measured)) == r.measured
        assert dict(zip(LV.MEMORY_PARTS, got.predicted)) == r.predicted
    measured, predicted = p.ranks[5].part("grads")
    assert measured - predicted == 64  # the planted leak, in bytes
    assert p.ranks[4].part("grads")[0] == p.ranks[4].part("grads")[1]


class _Published:
    def __init__(self):
        self.got = []

    def step_views(self, sync, memory):
        self.got.append((sync, memory))


def _answer(rank, snap):
    return {"gradsync": [ddp_record(rank)], "memory": snap}


def test_after_a_train_call_each_ranks_step_is_asked_once_and_published(caplog):
    from types import SimpleNamespace

    from dpnb.engine import entrypoints as ep
    from dpnb.session import verbs

    snaps = [dict(s, world_size=2) for s in snapshots32("ddp")[:2]]
    asked = []

    def call(name, *a, **kw):
        asked.append(name)
        return SimpleNamespace(values=[_answer(0, snaps[0]), _answer(1, snaps[1])])

    c = SimpleNamespace(published=_Published(), world_size=2, call=call)
    verbs.publish_step_views(c)
    assert asked == [ep.STEP_VIEWS]  # one engine call, every rank answers in it
    (sync, mem), = c.published.got
    assert sync.step == 5 and [r.rank for r in sync.ranks] == [0, 1]
    assert mem.world_size == 2 and mem.ranks[1].part("params")[0] == snaps[1]["measured"]["params"]

    def fails(name, *a, **kw):
        raise RuntimeError("rank 1 died")

    c = SimpleNamespace(published=_Published(), world_size=2, call=fails)
    verbs.publish_step_views(c)  # the panels miss a step; the caller's training result stands
    assert c.published.got == []
    assert "the step's views for JupyterLab were not read: RuntimeError: rank 1 died" in caplog.text
