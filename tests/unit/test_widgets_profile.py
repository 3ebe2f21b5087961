"""dpnb.widgets.profile on synthetic profiles: lanes chosen, errors, text, links, figure."""

import os

import pytest

from dpnb.core import profile as P
from dpnb.errors import RankSpecError
from dpnb.widgets import ViewError
from dpnb.widgets import profile as V


def _rank(r: int, late_us: float) -> P.RankTrace:
    a = 1000 + late_us
    ev = [{"ph": "X", "name": P.CLOCK_MARKER, "cat": "user_annotation", "ts": 0, "dur": 1, "tid": 1},
          {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 500, "tid": 1},
          {"ph": "X", "name": "c10d::allreduce_", "cat": "cpu_op", "ts": a, "dur": 5, "tid": 1},
          {"ph": "X", "name": "gloo:all_reduce", "cat": "user_annotation", "ts": a + 1,
           "dur": 60_000 - a, "tid": 2, "args": {"Input Dims": [[1024]], "Input type": ["float"]}}]
    return P.extract(ev, rank=r, host="h")


def _profiled(n: int, late: int, folder: str = "/nowhere") -> P.Profiled:
    ranks = [_rank(r, 30_000 if r == late else 0) for r in range(n)]
    return P.Profiled(P.analyze(ranks, n), folder, "cell")


def test_a_large_cluster_draws_the_straggler_among_a_few_lanes():
    d = V.data(_profiled(12, late=10))
    assert len(d.shown) == V.MAX_LANES and 10 in d.shown and 0 in d.shown and 11 in d.shown
    assert "Straggler: rank 10 entered 1 of 1 collectives last, typically 30.00 ms" in V.text(d)
    fig = V.figure(d)
    assert len(fig.axes) == 2 and len(fig.axes[0].get_yticklabels()) == 2 * V.MAX_LANES


def test_rank_choice_and_missing_profile_are_one_line_errors():
    p = _profiled(3, late=1)
    assert V.data(p, ranks="1").shown == (1,)
    with pytest.raises(RankSpecError, match="rank 5 out of range: the cluster has 3 ranks"):
        V.data(p, ranks=[5])
    some = P.Profiled(P.analyze([_rank(0, 0), _rank(2, 0)], 3), "/nowhere", "cell")  # --ranks 0,2
    with pytest.raises(ViewError, match=r"ranks \[1\] were not profiled \(profiled: \[0, 2\]\)"):
        V.data(some, ranks="1")
    with pytest.raises(ViewError, match="no profile yet: run a cell with %%dp --profile"):
        V.data(None, cluster=None)


def test_the_trace_files_are_links_relative_to_the_notebook(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "dpnb-profiles" / "t"
    folder.mkdir(parents=True)
    for f in ("merged.json", "rank0.json"):
        (folder / f).write_text("{}")
    html = V.html(V.data(_profiled(2, late=1, folder=str(folder))))
    assert "href='dpnb-profiles/t/merged.json'" in html and "href='dpnb-profiles/t/rank0.json'" in html
    assert "rank1.json" not in html  # only files that are there
    elsewhere = V.html(V.data(_profiled(2, late=1, folder=os.path.dirname(str(tmp_path)))))
    assert "href=" not in elsewhere  # outside the notebook's folder: no link
