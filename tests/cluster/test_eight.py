"""The spine at 8 ranks on this machine: cell, output folding, all_reduce, a
push through the controller's broadcast tree, a raising rank released at
once, status grouped, stop with nothing left."""



import dpnb
from dpnb import display
from helpers.nbutil import alive
from helpers.releases import raise_before_all_reduce


def test_eight_ranks_spine(capsys, monkeypatch):
    c = dpnb.start(8, timeout=20, threads=1)
    try:
        assert c.world_size == 8
        r = c.run("print('same')\nif rank == 5:\n    print('odd one')")
        assert r.ok
        out = capsys.readouterr().out
        assert "[ranks 0-4,6-7]\nsame\n" in out and "[rank 5]\nsame\nodd one" in out
        c.run("print('same')")
        assert "[all 8 ranks]\nsame" in capsys.readouterr().out
        assert c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = t.item()", display=False).ok
        assert c.pull("out") == [8.0] * 8
        # 8 ranks: a push leaves once, through ipyparallel's BroadcastView
        # (one request for all, each rank's own reply)
        trees, make = [], c.transport.client.broadcast_view
        monkeypatch.setattr(c.transport.client, "broadcast_view",
                            lambda **kw: trees.append(kw) or make(**kw))
        c.push({"pushed": list(range(1000))})
        assert len(trees) == 1 and trees[0]["is_coalescing"] is False
        assert c.run("assert pushed == list(range(1000))", display=False).ok
        err, took = raise_before_all_reduce(c, 3, "KeyError('only 3')")
        assert took < 15  # released, not the 20 s group timeout
        assert err.failures[3][0] == "KeyError"
        assert err.waiting == [0, 1, 2, 4, 5, 6, 7]
        assert "ranks 0-2,4-7 were waiting on rank 3" in err.report
        assert c.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 8", display=False).ok
        text = display.status_text(c.status())
        assert text.splitlines()[0].startswith("rank ")  # 8 ranks: still one row each
        owned = c.procs.owned(c.ranks)
    finally:
        c.stop()
    assert alive(owned, wait_s=5) == {}
