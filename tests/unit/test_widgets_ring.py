"""Ring all-reduce view: the schedule, bytes per step, the figure, the live result."""

import pytest

from dpnb.core import collective_bytes
from dpnb.widgets import ring


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_schedule_reduce_scatter_then_all_gather(n):
    steps = ring.ring_steps(n)
    assert len(steps) == 1 + 2 * (n - 1)
    everyone = frozenset(range(n))
    after_rs = steps[n - 1]
    assert after_rs.phase == "reduce-scatter" and after_rs.index == n - 1
    for r in range(n):  # like reduce_scatter_tensor: rank r owns the full sum of chunk r
        assert after_rs.holds[r][r] == everyone
    assert all(x == everyone for row in steps[-1].holds for x in row)
    for st in steps[1:]:
        assert sorted(src for src, _d, _c in st.sends) == list(range(n))  # every rank sends one chunk
        assert all(dst == (src + 1) % n for src, dst, _c in st.sends)


def test_bytes_per_step_and_total():
    d = ring.data(4, 1e6)
    assert d.chunk_bytes == 250_000
    assert d.bytes_per_rank == collective_bytes("all_reduce", 1e6, 4) == 1.5e6
    rows = ring.step_rows(d)
    assert len(rows) == 6 and rows[-1][-1] == "1.5 MB" and rows[0][2].startswith("0→1: chunk 3")


def test_figure_panels_cells_and_titles():
    d = ring.data(4, 1e6)
    fig = ring.figure(d)
    panels = [ax for ax in fig.axes if ax.patches]
    assert len(panels) == 7
    counts = [sorted(p._dpnb_ring for p in ax.patches) for ax in panels]
    assert all(k == 1 for _r, _c, k in counts[0])
    assert all(k == 4 for _r, _c, k in counts[-1])
    assert panels[1].get_title().startswith("RS step 1/3") and "250 kB" in panels[1].get_title()
    assert panels[4].get_title().startswith("AG step 1/3")
    big = ring.figure(ring.data(8, 1e6))
    assert len([ax for ax in big.axes if ax.patches]) == 5  # start, first/last of each phase
    one = ring.figure(d, step=3)
    assert len([ax for ax in one.axes if ax.patches]) == 1


def live_results(equal=True):
    x = [[1.0, 2.0, 3.0, 4.0], [5.0, -6.0, 7.0, 0.0]]
    s = [a + b for a, b in zip(*x)]
    return [{"rank": r, "world_size": 2, "numel": 4, "bytes": 16, "chunk_numel": 2, "shown_all": True,
             "input": x[r], "shard": s[2 * r:2 * r + 2], "gathered": s, "allreduce": s if equal else [0.0] * 4,
             "equal": equal, "max_abs_diff": 0.0 if equal else 10.0, "reduce_scatter_s": 4e-4,
             "all_gather_s": 3e-4, "all_reduce_s": 5e-4} for r in range(2)]


def test_live_result_in_text_and_figure():
    lv = ring.live_from_ranks(live_results())
    d = ring.data(live=lv, size_bytes=16)
    assert d.n == 2 and lv.equal and lv.shards == ((6.0, -4.0), (10.0, 4.0))
    txt = ring.text(d)
    assert "== all_reduce (max |diff| 0)" in txt and "[6, -4, 10, 4]" in txt
    fig = ring.figure(d)
    bars = [ax for ax in fig.axes if ax.containers][0]
    assert [round(b.get_height(), 6) for b in bars.containers[0]] == [0.4, 0.3, 0.7, 0.5]
    assert "==" in bars.get_title()
    bad = ring.data(live=ring.live_from_ranks(live_results(equal=False)))
    assert "!= all_reduce" in ring.text(bad)


def test_widget_step_slider():
    box = ring.view(n=3, size_bytes=3e6)
    assert len([ax for ax in box.figure.axes if ax.patches]) == 5
    box.controls["step"].value = 2
    assert len([ax for ax in box.figure.axes if ax.patches]) == 1
    box.controls["n"].value = 5
    assert box.data.n == 5 and box.data.chunk_bytes == pytest.approx(6e5)
