"""Mistakes are cheap: a raising rank releases its peers at once, mismatched
collectives in cells cost no engine, a stuck cell says where each rank is,
the last failure can be inspected, and training checkpoints itself.

The group timeout is the default, torch's 30 minutes, throughout: every
"released quickly" bound below (a generous 6 s, to prove "not the timeout",
never a speed; the figures are in benchmarks/RESULTS.md) would fail by half an
hour if a rank waited for it.
"""

from __future__ import annotations

import os
import re
import time

import pytest

import dpnb
from dpnb.cluster.diagnose import cell_notes
from dpnb.core.errors import UserError
from dpnb.errors import DpnbError, RemoteCellError
from helpers.releases import raise_before_all_reduce

QUICK_S = 6.0  # far below the group timeout (torch's 30 min)
NATIVE = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


@pytest.fixture(scope="module")
def c():
    cl = dpnb.start(2)  # default group timeout: torch's 30 min
    yield cl
    cl.stop()


def _raises(c, code, **kw) -> tuple[RemoteCellError, float]:
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run(code, display=False, **kw)
    return ei.value, time.monotonic() - t0


def _healthy(c) -> None:
    assert c.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == world_size",
                 display=False).ok


def test_raise_before_all_reduce_releases_the_peer_at_once(c):
    assert c.timeout_s == 1800.0  # torch's default for gloo: only a release makes this quick
    c.run("kept = rank * 10", display=False)
    pids, gen = [r.pid for r in c.ranks], c.generation
    err, took = raise_before_all_reduce(c)  # rank 1 raises ValueError('typo') at line 3
    assert took < QUICK_S, f"the peer waited {took:.1f} s: not released"
    assert err.summary.startswith("rank 1 raised ValueError; rank 0 waiting on rank 1")
    assert set(err.failures) == {0, 1} and err.failures[1][0] == "ValueError"
    assert err.waiting == [0] and "rank 0 was waiting on rank 1" in err.report
    assert "rank 1 raised ValueError: typo" in err.report
    assert "at cell line 3: raise ValueError('typo')" in err.report
    assert err.report.count("Traceback") == 1  # the user's traceback once; not the waiter's
    # no native log lines of torch/gloo (glog's "W0102 12:34:56") and no c10d internals
    assert not NATIVE.search(err.report) and "monitoredBarrier" not in err.report, err.report
    assert "released" in err.report and err.reformed and c.generation == gen + 1
    assert [r.pid for r in c.ranks] == pids and c.pull("kept") == [0, 10]
    _healthy(c)


@pytest.mark.parametrize("code,want", [
    ("t = torch.ones(4 + rank)\ndist.all_reduce(t)",
     ["rank 0: all_reduce [4] float32 at cell line 2", "rank 1: all_reduce [5] float32"]),
    ("t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)\ndist.all_reduce(t)",
     ["rank 0: all_reduce [4] float32", "rank 1: all_reduce [4] float64"]),
    ("t = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, src=0)",
     ["rank 0: all_reduce [4] float32 at cell line 3", "rank 1: broadcast [4] float32 src=0 at cell line 5"]),
], ids=["shape", "dtype", "op"])
def test_collective_mismatch_in_a_cell_keeps_every_engine(c, code, want):
    c.run("kept = 'still here'", display=False)
    pids = [r.pid for r in c.ranks]
    err, took = _raises(c, code)
    assert took < QUICK_S
    assert "collective mismatch" in err.report and "cell line" in err.report, err.report
    for w in want:
        assert w in err.report, err.report
    assert [r.pid for r in c.ranks] == pids and not c.dead
    assert c.pull("kept") == ["still here", "still here"]
    _healthy(c)


def test_one_sided_collective_is_released_at_once_and_says_who_is_blocked_where(c):
    # no cell timeout: rank 0 finished, so rank 1's all_reduce can never complete
    err, took = _raises(c, "t = torch.ones(3)\nif rank == 1:\n    dist.all_reduce(t)\n")
    assert took < 2.0, took  # only a release ends it before the 30-minute group timeout
    assert "rank 1 is blocked in all_reduce #1 (shape [3], float32) at cell line 3" in err.report, \
        err.report
    assert "rank 0 finished the cell without entering it" in err.report, err.report
    assert err.summary.startswith("rank 1 blocked in a collective no rank could join")
    # a recv whose sender finished, and a collective on a cell run on one rank only
    err, took = _raises(c, "t = torch.ones(2)\nif rank == 1:\n    dist.recv(t, src=0)\n")
    assert took < 2.0 and "rank 0 finished the cell without a matching send" in err.report
    # the same waited on through irecv / isend, as halo exchanges and course rings write
    # it: seen hanging until the cell's timeout while the rank sat in the request's wait()
    err, took = _raises(c, "t = torch.ones(2)\nif rank == 0:\n    kept_req = dist.isend(t, dst=1)\nelse:\n"
                           "    dist.irecv(t, src=0).wait()\n    dist.irecv(t, src=0).wait()\n",
                        timeout=10)  # without the release: 10 s, the cell's timeout
    assert took < 2.0, took
    assert "rank 1 is blocked in irecv #2 (shape [2], float32) at cell line 6" in err.report, \
        err.report
    assert "rank 0 finished the cell after only 1 send" in err.report, err.report
    assert "its irecv peer, rank 0, is not running the cell" in err.report, err.report
    err, took = _raises(c, "t = torch.ones(2)\nif rank == 0:\n    req = dist.isend(t, dst=1)\n"
                           "    req.wait()\n", timeout=10)
    assert took < 2.0 and "rank 1 finished the cell without a matching recv" in err.report, \
        err.report
    err, took = _raises(c, "dist.barrier()", ranks=[0])
    assert took < 2.0 and "rank 1 does not run this cell" in err.report, err.report
    _healthy(c)


PAIRED = "was paired with"


def test_calls_paired_across_lines_are_named_in_the_report(c):
    # issue 37: rank 0's line-2 all_reduce pairs with rank 1's line-4 one (same
    # shape, so no mismatch); rank 0's line-4 call then finds no partner
    err, took = _raises(c, "a = torch.ones(3) * (rank + 1)\nif rank == 0: dist.all_reduce(a)\n"
                           "b = torch.ones(3) * 10 * (rank + 1)\ndist.all_reduce(b)\n")
    assert took < QUICK_S, took
    assert err.summary.startswith("rank 0 blocked in a collective no rank could join")
    assert ("rank 0's all_reduce at cell line 2 was paired with rank 1's all_reduce at cell "
            "line 4: both results mix values from different lines") in err.report, err.report
    assert c.pull("b", rank=1).tolist() == [21.0] * 3  # the mixed value the note explains
    _healthy(c)


def test_swapped_calls_and_branches_get_a_note_never_an_error(c):
    # two same-shape all_reduces in swapped order: no error, values mixed -> a note
    r = c.run("x = torch.ones(2) * (rank + 1); y = torch.ones(2) * 10 * (rank + 1)\n"
              "if rank == 0:\n    dist.all_reduce(x)\n    dist.all_reduce(y)\nelse:\n"
              "    dist.all_reduce(y)\n    dist.all_reduce(x)\n", display=False)
    assert r.ok
    notes = {n for o in r.outcomes.values() for n in o.notes}
    assert notes == {f"rank 0's all_reduce at cell line {a} {PAIRED} rank 1's all_reduce at cell "
                     f"line {b}: both results mix values from different lines"
                     for a, b in ((3, 6), (4, 7))}, notes
    # an if/else whose branches make the same collective, in a loop: a note, no error
    r = c.run("t = torch.ones(1)\nfor i in range(40):\n    if rank == 0: dist.all_reduce(t)\n"
              "    else: dist.all_reduce(t)\n", display=False)
    assert r.ok and c.pull("t") == [2.0 ** 40] * 2
    assert all(len(o.notes) == 1 and PAIRED in o.notes[0] for o in r.outcomes.values())
    # the same line on every rank: nothing to say
    r = c.run("t = torch.ones(1)\nfor i in range(5):\n    dist.all_reduce(t)\n", display=False)
    assert r.ok and not any(o.notes for o in r.outcomes.values())


def test_identical_code_on_every_rank_gives_no_note_and_a_real_move_still_does(c):
    # issue 58: a barrier after a loop of barriers, identical on every rank, repeats the
    # agreed loop from another line on every rank alike: it paired line with line
    r = c.run("for i in range(3):\n    dist.barrier()\ndist.barrier()\n", display=False)
    assert r.ok and cell_notes(r) == [], cell_notes(r)
    # a hand-written ZeRO-style loop: reduce_scatter, all_gather, a barrier in the loop
    # and one after it, as course notebooks write it
    r = c.run("w = torch.ones(8)\nfor step in range(4):\n    g = torch.ones(8) * (rank + 1)\n"
              "    shard = torch.empty(4)\n    dist.reduce_scatter_tensor(shard, g)\n"
              "    full = torch.empty(8)\n    dist.all_gather_into_tensor(full, shard)\n"
              "    w -= 0.1 * full\n    dist.barrier()\ndist.barrier()\n", display=False)
    assert r.ok and cell_notes(r) == [], cell_notes(r)
    # rank 1's last call of the loop comes from another line than rank 0's: said
    r = c.run("t = torch.ones(1)\nfor i in range(4):\n"
              "    if rank == 0 or i < 3: dist.all_reduce(t)\n"
              "    else: dist.all_reduce(t)\n", display=False)
    assert r.ok and cell_notes(r) == [
        "all_reduce was called from different lines on different ranks after repeating the "
        "agreed loop (not compared: rank 0 at cell line 3; rank 1 at cell line 4): each result "
        "may mix values from these lines"], cell_notes(r)


def test_an_uneven_last_batch_in_a_checked_loop_costs_no_engine(c):
    # the loop's all_reduce repeats, so after two rounds it runs without a check
    # (dpnb.engine.cell.collcheck.Pattern); rank 1's smaller last batch is checked and
    # never reaches gloo, which would abort on the size mismatch
    pids = [r.pid for r in c.ranks]
    err, took = _raises(c, "for i in range(6):\n    t = torch.ones(3 if (rank == 1 and i == 5) "
                           "else 4)\n    dist.all_reduce(t)\n")
    assert took < QUICK_S, took
    assert "rank 0 is blocked in all_reduce #6 (shape [4], float32)" in err.report, err.report
    assert "rank 1 is blocked in all_reduce #6 (shape [3], float32)" in err.report, err.report
    assert [r.pid for r in c.ranks] == pids and not c.dead
    _healthy(c)


def test_debug_shows_the_failing_ranks_locals(c):
    c.last_failure = None
    with pytest.raises(DpnbError, match="no cell has failed yet"):
        c.debug()
    _raises(c, "x = torch.zeros(3, 5)\nlabel = 'abc' * 100\nif rank == 0:\n"
               "    raise RuntimeError('boom')\n")
    text = c.debug()
    assert "RuntimeError: boom" in text
    assert "x = Tensor shape=[3, 5] dtype=torch.float32 device=cpu" in text
    assert "label = 'abcabc" in text and len(max(text.splitlines(), key=len)) < 200
    with pytest.raises(DpnbError, match="not a rank of this cluster"):
        c.debug(7)
    assert "idle" in c.where()


def test_an_error_alike_on_every_rank_is_written_by_dpnb_and_shown_once(c):
    """Each rank writes its traceback with dpnb.engine.debugging.tbtext (IPython's layout,
    no colours, no scan of torch's modules); the notebook shows it once."""
    err, _ = _raises(c, "def check(v):\n    raise ValueError(f'bad {v}')\nx = 1\ncheck(x)\n")
    assert err.summary.startswith("ranks 0-1 raised ValueError"), err.summary
    assert "at cell line 2: raise ValueError(f'bad {v}')" in err.report, err.report
    assert err.report.count("Traceback") == 1, err.report
    for ename, evalue, tb in err.failures.values():
        assert (ename, evalue) == ("ValueError", "bad 1")
        assert "\x1b[" not in tb and "----> 4 check(x)" in tb and ", in check(v)" in tb, tb
    assert c.run("x", display=False).ok  # the engines keep going, group untouched


def test_checkpoint_every_k_then_resume_loses_at_most_k_steps(c, tmp_path):
    c.run("import dpnb.data\ntorch.manual_seed(0)\n"
          "ds = dpnb.data.SyntheticRegression(n=256, in_dim=8, out_dim=1, seed=0)\n"
          "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), "
          "torch.nn.Linear(16, 1))", display=False, setup=True)
    c.wrap("net", "ddp", lr=0.01)
    c.set_data("ds")
    with pytest.raises(UserError, match="whole number of steps >= 1"):
        c.train(steps=2, micro_batch=8, progress=False, checkpoint_every=0,
                checkpoint_dir=str(tmp_path))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DpnbError, match="cannot write checkpoints to"):
        c.train(steps=2, micro_batch=8, progress=False, checkpoint_every=2,
                checkpoint_dir=str(blocker / "sub"))
    ck = tmp_path / "auto"
    s = c.train(steps=7, micro_batch=8, progress=False, checkpoint_every=3, checkpoint_dir=str(ck))
    assert s["last_step"] == 6 and len(s["checkpoints"]) == 2  # after steps 3 and 6
    assert sorted(p for p in os.listdir(ck) if p.startswith("step-")) == \
        ["step-00000003", "step-00000006"]
    with pytest.raises(RemoteCellError):
        c.run("import os\nif rank == 1:\n    os._exit(9)\ndist.barrier()", display=False)
    msg = c.restart(resume="")  # memory first: a survivor's replica is fresher than step 6's
    assert "rebuilt from rank 0's replica at step 7 (0 steps lost" in msg, msg
    nxt = c.train(steps=1, micro_batch=8, progress=False)
    assert nxt["first_step"] == 7
    assert c.check()["ok"]
    c.run("other = torch.nn.Linear(3, 3)", display=False)
    c.wrap("other", "ddp")
    with pytest.raises(DpnbError, match="holds checkpoints of another model"):
        c.train(steps=1, micro_batch=8, progress=False, checkpoint_every=1, checkpoint_dir=str(ck))


def test_uneven_data_is_said_once(c):
    c.run("import dpnb.data\nsmall = dpnb.data.SyntheticRegression(n=7, in_dim=8, out_dim=1)\n"
          "lin = torch.nn.Linear(8, 1)", display=False)
    c.wrap("lin", "ddp")
    c.set_data("small")
    s = c.train(steps=1, micro_batch=2, progress=False)
    assert s["data_note"].startswith("an epoch uses 4 of the 7 samples and drops 3")
    assert "each of the 2 ranks 3 (drop_last: 1 left over)" in s["data_note"]
    assert c.train(steps=1, micro_batch=2, progress=False)["data_note"] is None  # said once


def test_a_value_the_notebook_cannot_rebuild_is_said_in_a_line(c):
    """It pickles on the engine, but its rebuild needs something only the
    engine has (a hook-free DDP needs a process group): the pull used to fail
    inside ipyparallel's I/O thread and wait forever."""
    c.run("def _only_here():\n    return 1\n"
          "class Stubborn:\n    def __reduce__(self):\n        return (_only_here, ())\n"
          "stubborn = Stubborn()", display=False)
    t0 = time.monotonic()
    with pytest.raises(DpnbError, match=r"'stubborn' cannot be sent to the notebook \(rebuilding"):
        c.pull("stubborn", rank=0)
    assert time.monotonic() - t0 < QUICK_S
    _healthy(c)  # nothing on the engines was harmed


def test_a_value_that_does_not_serialize_on_the_engine_is_said_in_a_line(c):
    c.run("import threading\nheld = threading.Lock()", display=False)
    with pytest.raises(DpnbError, match=r"'held' cannot be sent to the notebook \(TypeError: .*lock.*pull-model"):
        c.pull("held", rank=0)
    _healthy(c)


def test_the_startup_heap_is_frozen_and_what_cells_make_is_still_collected(c):
    """dpnb.engine.proc.process.freeze_startup_heap: a full collection no longer
    walks torch, IPython and ipyparallel, and a cell's own cyclic garbage is
    still freed."""
    c.run("import gc, weakref\nclass _Node:\n    pass\nnode = _Node()\nnode.me = node\n"
          "alive = weakref.ref(node)\ndel node\ngc.collect()\ngone = alive() is None\n"
          "frozen = gc.get_freeze_count()", display=False)
    assert c.pull("gone") == [True, True]
    assert all(n > 50_000 for n in c.pull("frozen")), c.pull("frozen")


def test_every_rank_dying_says_nothing_was_kept(c):
    """Last in this module: it leaves no engine alive (the fixture's stop follows)."""
    with pytest.raises(RemoteCellError) as ei:
        c.run("import os\nos._exit(5)", display=False)
    assert ei.value.died == {0: "exit code 5", 1: "exit code 5"}
    assert "no rank survived, so nothing on the engines was kept" in ei.value.report
    assert "ranks  " not in ei.value.report  # never an empty rank list


def test_a_mistake_after_a_plain_restart_of_a_wrapped_model_costs_no_engine():
    """DDP wrapped, a rank killed and replaced by ``restart`` without ``--resume``
    (the fresh rank holds no model), then a cell that raises on one rank while the
    other waits in an all_reduce: the next cell's re-formation must not re-bind the
    survivor's DDP alone -- its broadcast against the fresh rank's next collective
    is a size mismatch gloo aborts the process for (the fresh rank died with
    SIGABRT before).  Every rank lives; training says to wrap again."""
    with dpnb.start(2) as c:
        c.run("net = torch.nn.Linear(4, 1)", display=False)
        c.wrap("net", "ddp", lr=1e-2)
        c.kill_rank(1)
        assert "rank 1 replaced" in c.restart()
        _raises(c, "import time\nif rank == 0:\n    raise ValueError('boom')\n"
                   "time.sleep(0.3)\ndist.all_reduce(torch.ones(1))")
        c.run("t = torch.ones(1)\ndist.all_reduce(t)\nsum_ = t.item()", display=False)
        assert list(c.pull("sum_")) == [2.0, 2.0] and not c.dead
        with pytest.raises(RemoteCellError) as ei:
            c.train(steps=1, micro_batch=2, progress=False)
        assert "%dp wrap" in ei.value.report, ei.value.report
