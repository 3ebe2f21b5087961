"""Faults on a 3-engine cluster: the report names the one culprit and both
waiting ranks; recovery keeps the world at 3 with the survivors' state."""


import pytest

import dpnb
from helpers.releases import raise_before_all_reduce


TIMEOUT = 6.0


@pytest.fixture(scope="module")
def c3():
    c = dpnb.start(3, timeout=TIMEOUT)
    yield c
    c.stop()


def test_three_ranks_one_raises_two_wait(c3):
    c3.run("mine = torch.full((2,), float(rank))", display=False)
    e, took = raise_before_all_reduce(c3, 1, "KeyError('only rank 1')")
    assert took < TIMEOUT / 2  # released, not the 6 s group timeout
    assert e.failures[1][0] == "KeyError" and e.waiting == [0, 2]
    assert "ranks 0,2 were waiting on rank 1" in e.report and e.reformed
    r = c3.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), mine.tolist())",
               display=False)
    assert r.ok and c3.pull("out") == [(3.0, [0.0, 0.0]), (3.0, [1.0, 1.0]), (3.0, [2.0, 2.0])]


def test_three_ranks_hang_names_the_rank_that_did_not_arrive(c3):
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c3.run("import time\nt = torch.ones(1)\nif rank == 2:\n    time.sleep(60)\n"
               "else:\n    dist.all_reduce(t)", timeout=TIMEOUT + 3, display=False)
    e = ei.value
    assert e.timed_out == [2] and e.waiting == [0, 1]
    assert f"rank 2 did not finish within the cell's {TIMEOUT + 3:g} s timeout" in e.report
    assert c3.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 3",
                  display=False).ok


def test_three_ranks_one_dies_restart_restores_three(c3):
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c3.run("import os\nif rank == 2:\n    os._exit(4)\ndist.barrier()", display=False)
    assert ei.value.died == {2: "exit code 4"}
    assert "rank 2 died: exit code 4" in ei.value.report
    msg = c3.restart()
    assert "rank 2 replaced" in msg and "ranks 0-1 keep their state" in msg
    r = c3.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), "
               "globals().get('mine') is not None)", display=False)
    assert r.ok and c3.pull("out") == [(3.0, True), (3.0, True), (3.0, False)]
