"""Dashboard: status + summaries + datapub progress combined; the figure; the poller's source."""

import math

import pytest

from dpnb import display
from dpnb.widgets import dashboard
from helpers.recorded import status32

STATUS = [{"rank": r, "host": "node0", "pid": 100 + r, "engine_id": r, "device": "cpu", "backend": "gloo",
           "alive": r == 0, "state": "ok" if r == 0 else "dead: killed by signal 9", "group": True,
           "rss_bytes": (400 + 50 * r) * 2**20, "cuda_allocated": None} for r in range(2)]
SUMMARIES = [{"rank": r, "world_size": 2, "strategy": "ddp", "last": {"bytes": {"total": 120_000}},
              "history": [[s, 2.0 * math.exp(-s / 10), 900.0 + s] for s in range(20)]} for r in range(2)]
PROGRESS = {0: {"rank": 0, "step": 21, "done": 2, "total": 50, "loss": 0.25, "samples_per_s": 1000.0,
                "tokens_per_s": None, "history": [[20, 0.26], [21, 0.25]]}}


def test_data_combines_sources():
    d = dashboard.data(STATUS, SUMMARIES, PROGRESS, running=True)
    assert [h[0] for h in d.history] == list(range(22))
    assert d.history[-1] == (21, 0.25, 1000.0)
    assert d.memory[0] == {"rank": 0, "rss_bytes": 400 * 2**20, "cuda_allocated": None, "state_bytes": 120_000}
    txt = dashboard.text(d)
    assert "2 ranks, 1 alive, ddp" in txt and "training: step 21 (2/50), loss 0.25, 1,000.0 samples/s" in txt
    assert "400 MiB" in txt and "NO" in txt and "120 kB" in txt


def test_figure_shows_loss_throughput_memory():
    d = dashboard.data(STATUS, SUMMARIES, PROGRESS)
    fig = dashboard.figure(d)
    ax, ax2, ax3 = fig.axes[:3]
    assert list(ax.lines[0].get_ydata())[-1] == pytest.approx(0.25)
    assert list(ax2.lines[0].get_ydata())[-1] == pytest.approx(1000.0)
    heights = [p.get_height() for p in ax3.patches]
    assert 400 * 2**20 in heights and 120_000 in heights
    assert ax3.get_yscale() == "log"  # RSS and model states differ by > 50×
    assert "step 21" in fig._suptitle.get_text()


def test_empty_dashboard():
    d = dashboard.data()
    assert "no training yet" in dashboard.text(d)
    fig = dashboard.figure(d)
    assert "no steps yet" in fig.axes[0].texts[0].get_text()


class FakeClient:
    def __init__(self):
        self.outstanding = {"a", "b", "c"}
        self.metadata = {"a": {"data": {"dpnb_progress": {"rank": 0, "step": 3}}},
                         "b": {"data": {"dpnb_progress": {"rank": 1, "step": 2}}},
                         "c": {"data": {}}}


def test_progress_from_client_reads_datapub_metadata():
    p = dashboard.progress_from_client(FakeClient())
    assert p == {0: {"rank": 0, "step": 3}, 1: {"rank": 1, "step": 2}}


def test_progress_survives_the_request_finishing():
    """A run shorter than the polling interval: once its request is no longer
    outstanding, the last payload is still read from the ids seen before."""
    client = FakeClient()
    seen: dict = {}
    assert dashboard.progress_from_client(client, seen)[0]["step"] == 3
    assert set(seen) == {"a", "b"}
    client.metadata["a"]["data"]["dpnb_progress"]["step"] = 19  # final publish
    client.outstanding = set()  # training finished between two polls
    p = dashboard.progress_from_client(client, seen)
    assert p[0]["step"] == 19 and p[1]["step"] == 2
    assert dashboard.progress_from_client(client) == {}  # without memory: lost


def test_widget_without_cluster():
    box = dashboard.view(status=STATUS, summaries=SUMMARIES, progress=PROGRESS)
    assert box.poller is None and box.data.last["step"] == 21
    assert "Cluster status" in box.readout.value
    box.stop()


def test_each_step_keeps_its_own_throughput():
    """Published history carries (step, loss, samples/s): the throughput curve
    is per step, not the latest value painted over every step."""
    p = {"rank": 0, "step": 2, "done": 3, "total": 3, "loss": 1.0, "samples_per_s": 300.0,
         "history": [[0, 3.0, 100.0], [1, 2.0, 200.0], [2, 1.0, 300.0]]}
    d = dashboard.data(progress={0: p})
    assert [h[2] for h in d.history] == [100.0, 200.0, 300.0]


def test_32_ranks_status_groups_agreeing_ranks_and_spells_out_the_odd_one():
    d = dashboard.data(status32(), [], {})
    rows = dashboard.status_rows(d)
    assert [r[0] for r in rows] == ["ranks 0-12,14-15", "rank 13", "ranks 16-31"]
    assert rows[1][5] == "NO" and rows[0][2] == "15 engines"
    assert rows[2][7] == "416 MiB - 431 MiB"
    fig = dashboard.figure(d)
    ax3 = fig.axes[2]
    # the largest bar only, and the dead rank 13 marked
    assert len(ax3.get_xticklabels()) == 8 and len(ax3.texts) == 2


def test_device_ranges():
    assert display.devices_label([f"cuda:{i}" for i in range(8)]) == "cuda:0-7"
    assert display.devices_label(["cpu", "cpu"]) == "cpu"


def test_status_text_at_32_ranks_is_three_lines_of_groups():
    lines = display.status_text(status32()).splitlines()
    assert lines[0].split()[:3] == ["ranks", "host", "engines"]
    assert len(lines) == 4 and "rank 13" in lines[2] and "NO" in lines[2]
    assert display.status_text(status32()[:2]).splitlines()[2].startswith("1 ")  # few ranks: one row each


def test_memory_panel_marks_a_dead_rank():
    fig = dashboard.figure(dashboard.data(status32(dead=(13,)), [], {}))
    marks = [t.get_text() for t in fig.axes[2].texts]
    assert "rank 13 dead" in marks
    assert not any("rank 12 dead" in m for m in marks)
