"""The spine through the Python API on a real 2-engine gloo cluster."""

import os
import signal
import threading
import time

import pytest

from dpnb.cluster import transport
from dpnb.ippcompat import reply_content, result_metadata
from dpnb.engine.cell import outcount
from dpnb.errors import DpnbError, RemoteCellError

GROUP_TIMEOUT = 6.0  # matches tests/cluster/conftest.py



def test_ranks_env_and_namespace(healthy):
    c = healthy
    assert [r.rank for r in c.ranks] == [0, 1]
    assert [r.local_rank for r in c.ranks] == [0, 1]
    assert c.backend == "gloo"  # no GPU here
    assert c.ranks[0].engine_id < c.ranks[1].engine_id
    res = c.run(
        "import os\n"
        "env = {k: os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE',"
        "'MASTER_ADDR','MASTER_PORT')}\n"
        "info = (rank, world_size, local_rank, str(device), torch.get_num_threads(), "
        "dist.is_initialized(), dist.get_rank(), dist.get_backend())",
        display=False)
    assert res.ok
    envs = c.pull("env")
    infos = c.pull("info")
    for r in (0, 1):
        assert envs[r]["RANK"] == str(r) and envs[r]["LOCAL_RANK"] == str(r)
        assert envs[r]["WORLD_SIZE"] == "2" and envs[r]["LOCAL_WORLD_SIZE"] == "2"
        assert envs[r]["MASTER_ADDR"] == "127.0.0.1"
        assert int(envs[r]["MASTER_PORT"]) == c.master_port
        rank, world, local, dev, threads, init, drank, backend = infos[r]
        assert (rank, world, local, dev, init, drank, backend) == (r, 2, r, "cpu", True, r, "gloo")
        # 2 cores shared by 2 engines: one torch thread each
        assert threads == max(1, (os.cpu_count() or 1) // 2)


def test_all_reduce_gives_sum_on_every_rank(healthy, capsys):
    healthy.run("t = torch.tensor([float(rank + 1)])\ndist.all_reduce(t)\nprint(t.item())")
    out = capsys.readouterr().out
    # identical output from both ranks is shown once, labelled with both ranks
    assert out == "[all 2 ranks]\n3.0\n"
    assert healthy.pull("t", rank=1).item() == 3.0


def test_different_output_is_grouped_per_rank(healthy, capsys):
    healthy.run("print('hello from', rank)")
    out = capsys.readouterr().out
    assert out == "[rank 0]\nhello from 0\n[rank 1]\nhello from 1\n"


OUTPUTS_CELL = """from IPython.display import HTML, display
import sys
for i in range(3):
    print(f'line {i} of rank {rank}')
print('x' * 100_000)
display(HTML(f'<b>{rank}</b>'))
print('warned', rank, file=sys.stderr)
rank * 10"""


def test_every_output_is_in_when_a_cell_returns(healthy, monkeypatch):
    """Issue 45: a rank's result is taken once the output its reply counts
    has arrived, not at the engine's idle message; every print, display,
    stderr line and value of every rank is there, in order, each time."""
    promised = []
    wait = transport.wait_for_output
    monkeypatch.setattr(transport, "wait_for_output", lambda ar, t: promised.append(
        reply_content(ar).get(outcount.KEY)) or wait(ar, t))
    for _ in range(5):
        res = healthy.run(OUTPUTS_CELL, display=False)
        for r in (0, 1):
            o = res.outcomes[r]
            assert o.stdout == "".join(f"line {i} of rank {r}\n" for i in range(3)) + "x" * 100_000 + "\n"
            stdout_chars = len(o.stdout)
            assert o.stderr == f"warned {r}\n"
            assert [d["data"]["text/html"] for d in o.outputs] == [f"<b>{r}</b>"]
            assert o.execute_result["data"]["text/plain"] == str(r * 10)
    # the counts were what it waited for, and they match what arrived
    assert promised == [{"stdout": stdout_chars, "stderr": 9, "displays": 1, "result": True}] * 10


def test_the_engines_do_not_echo_a_cell_s_source(healthy):
    """Issue 45: the notebook never shows the engines' echo of a cell's code
    (``execute_input``); N copies of it per cell cost 7-12 % of a ``pass``
    cell at N = 8 and 16."""
    ar = healthy.transport.view(1).execute("echoed = 1", silent=False, block=False)
    ar.get(10)
    assert ar.wait_for_output(10)  # idle: everything the engine published is in
    assert result_metadata(ar).get("execute_input") is None


def test_a_cell_leaves_for_every_rank_before_any_result_is_built(healthy, monkeypatch):
    """Issue 45: a cell's requests are sent in one loop, each rank's reply
    read off its message future after; built rank by rank between sends, the
    notebook's and the client's IO threads traded the GIL (10 ms to send to 16
    ranks, 2.4 raw).  One AsyncResult for the whole cell: one per rank
    (``split()``) was 16 % of the notebook's main thread per cell at N = 8."""
    from ipyparallel.client.asyncresult import AsyncResult  # lazy: the notebook side's client

    events = []
    client = healthy.transport.client
    send, init = client.send_execute_request, AsyncResult.__init__
    monkeypatch.setattr(client, "send_execute_request",
                        lambda *a, **k: events.append("send") or send(*a, **k))
    monkeypatch.setattr(AsyncResult, "__init__",
                        lambda self, *a, **k: events.append("result") or init(self, *a, **k))
    res = healthy.run("print(rank)", display=False)
    assert events[:2] == ["send", "send"]
    assert events.count("result") == 1
    assert [res.outcomes[r].stdout for r in (0, 1)] == ["0\n", "1\n"]


def test_a_pull_from_every_rank_leaves_through_one_view(healthy, monkeypatch):
    """Issue 45: the same call for several ranks (a pull, a push, an engine
    function) is sent as a cell is: one AsyncResult, each rank's reply read
    off its own message future, in rank order.  At N = 64 a pull built 64.
    And a pull takes each rank's value as its reply comes."""
    from ipyparallel.client.asyncresult import AsyncResult  # lazy: the notebook side's client

    healthy.run("pulled = rank * 10", display=False)
    made, init = [], AsyncResult.__init__
    monkeypatch.setattr(AsyncResult, "__init__",
                        lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    assert healthy.pull("pulled") == [0, 10]
    assert len(made) == 1
    # a value's move prints nothing: each engine's idle status, 4-5 ms behind
    # its reply, is not waited for (3 ms of a pull's 87 at N = 32)
    waited = []
    monkeypatch.setattr(transport, "wait_for_output", lambda ar, t: waited.append(ar) or True)
    assert healthy.pull("pulled", rank=1) == 10
    assert waited == []
    healthy.run("pass", display=False)
    assert len(waited) == 2  # a cell's output still is


def test_an_unchecked_cell_is_unchecked_on_every_rank_and_only_that_cell(healthy):
    """``%%dp --unchecked``: each rank is told, in the cell's own request (its last
    line, a comment), to count but not check that cell's collectives; the next
    cell is checked again.  One request per rank: the engines' queues show no
    other task for the unchecked cell.  Read from the calls the check saw, not from the guard's flag:
    the star numbers every collective handed to it (``Star.call``)."""
    probe = ("from dpnb.engine.state import get_state\n"
             "star = get_state(globals()).cell_guard.star\n"
             "s0 = star.seq\n"
             "t = torch.ones(1)\n"
             "for _ in range(3):\n"
             "    dist.all_reduce(t)\n"
             "checks = star.seq - s0\n"
             "total = t.item()")
    sent = []
    real = healthy.transport.call_async
    healthy.transport.call_async = lambda *a, **k: sent.append(a) or real(*a, **k)
    try:
        assert healthy.run(probe, display=False, unchecked=True).ok
    finally:
        del healthy.transport.call_async
    assert sent == []  # no request ahead of the cell: the flag travelled with it
    assert healthy.pull("checks") == [0, 0]
    assert healthy.pull("total") == [8.0, 8.0]  # the collectives themselves ran: 1 -> 2 -> 4 -> 8
    assert healthy.run(probe, display=False).ok
    assert healthy.pull("checks") == [3, 3]


def test_a_print_before_an_error_and_a_silent_cell_arrive(healthy):
    res = healthy.run("print('before', rank)\nraise ValueError('after a print')",
                      display=False, raise_errors=False)
    assert [res.outcomes[r].stdout for r in (0, 1)] == ["before 0\n", "before 1\n"]
    assert all(res.outcomes[r].ename == "ValueError" for r in (0, 1))
    res = healthy.run("pass", display=False)  # nothing published: nothing waited for
    assert all(not o.stdout and not o.outputs and o.execute_result is None
               for o in res.outcomes.values())


def test_a_cell_sent_right_behind_a_failing_one_still_runs(healthy):
    """ipykernel aborts the requests queued behind a failed one unless told not to;
    a script or an agent sends the next cell at once (a full run saw "rank 2 raised
    TaskAborted" after a released failure).  Both cells go out before the first
    has run: the second runs on every rank."""
    c = healthy
    first = c.transport.execute("import time\ntime.sleep(0.3)\nraise ValueError('first')", [0, 1])
    second = c.transport.execute("after_failure = rank + 1", [0, 1])
    for r in (0, 1):
        with pytest.raises(Exception, match="first"):
            first[r].get(timeout=30)
        second[r].get(timeout=30)  # TaskAborted here when the queue was cancelled
    assert c.pull("after_failure") == [1, 2]


def test_an_interrupt_that_lands_after_the_cells_code_does_not_cost_its_reply(healthy):
    """A rank interrupted just as it left the cell's code (a full run: a rank freed
    from a released point-to-point wait, SIGINT'd as still running) sent no reply
    and was "still running an earlier cell" for good.  Here the SIGINT lands in
    the kernel's own flush before the reply, every time: the reply comes back, and a
    SIGINT inside the code still stops it."""
    c = healthy
    # after the cell (post_run_cell), the next flush of stdout -- ipykernel's own,
    # right before it sends the reply -- sends this engine a SIGINT
    late = ("import os, signal, sys\nfrom IPython import get_ipython\n_out = sys.stdout\n"
            "def _flush_then_sigint():\n    del _out.flush\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    return _out.flush()\n"
            "def _arm(result):\n    get_ipython().events.unregister('post_run_cell', _arm)\n"
            "    _out.flush = _flush_then_sigint\n"
            "get_ipython().events.register('post_run_cell', _arm)\nlate = rank")
    ars = c.transport.execute(late, [0, 1])
    for r in (0, 1):
        ars[r].get(timeout=15)  # a TimeoutError here: the reply was lost
    assert c.pull("late") == [0, 1]
    res = c.run("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n"
                "not_reached = True", ranks=[0], display=False, raise_errors=False)
    assert res.outcomes[0].ename == "KeyboardInterrupt", res.outcomes[0]
    assert c.run("after = rank", display=False).ok


@pytest.mark.parametrize("spec,expected", [("0", [0]), ("1:", [1]), ("0,1", [0, 1]),
                                           (":1", [0]), ("all", [0, 1])])
def test_rank_selection(healthy, spec, expected):
    res = healthy.run("ran = True\nprint(rank)", ranks=spec, display=False)
    assert res.ranks == expected
    assert sorted(int(v.strip()) for v in res.stdout.values()) == expected


def test_push_pull(healthy):
    healthy.push({"cfg": {"lr": 0.1}, "n_items": 7})
    assert healthy.pull("cfg") == [{"lr": 0.1}, {"lr": 0.1}]
    healthy.push({"only_one": 5}, ranks="1")
    with pytest.raises(DpnbError, match=r"'only_one' is not defined on rank 0.*--rank 1"):
        healthy.pull("only_one")
    assert healthy.pull("only_one", rank=1) == 5


def test_pull_is_one_round_trip(healthy, monkeypatch):
    """A pull asks the ranks once, as ipyparallel's own pull (issue 45: a
    separate "is it defined?" round trip made it 1.4-1.9x raw)."""
    sent = []
    apply = healthy.transport.apply
    monkeypatch.setattr(healthy.transport, "apply",
                        lambda fn, *a, **k: sent.append(fn.__name__) or apply(fn, *a, **k))
    healthy.push({"one_trip": 3})
    sent.clear()
    assert healthy.pull("one_trip") == [3, 3]
    assert sent == ["get_value"]


def test_identical_failures_show_one_traceback(healthy):
    with pytest.raises(RemoteCellError) as ei:
        healthy.run("1/0", display=False)
    err = ei.value
    assert "ranks 0-1 raised ZeroDivisionError" in err.report
    assert err.report.count("Traceback") == 1
    assert err.waiting == [] and not err.reformed  # no collective involved


def test_cell_timeout_names_ranks_that_did_not_finish(healthy):
    c = healthy
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run("import time\nif rank == 0:\n    time.sleep(60)\n", timeout=2, display=False)
    assert time.monotonic() - t0 < 10
    assert ei.value.timed_out == [0]
    assert "rank 0 did not finish within the cell's 2 s timeout" in ei.value.report
    assert c.run("print(rank)", display=False).ok


def test_hang_in_collective_is_released_by_group_timeout(healthy):
    """Rank 0 enters an all_reduce that rank 1 never enters."""
    c = healthy
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run("import time\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
              "else:\n    time.sleep(60)", timeout=GROUP_TIMEOUT + 3, display=False)
    # the cell timeout (9 s) ends it, then the release: far from rank 1's 60 s sleep
    assert time.monotonic() - t0 < 2 * GROUP_TIMEOUT + 15
    err = ei.value
    assert err.timed_out == [1]
    assert err.waiting == [0] and "rank 0 was waiting on rank 1" in err.report
    assert c.run("u = torch.ones(1)\ndist.all_reduce(u)\nassert u.item() == 2", display=False).ok


def test_ctrl_c_interrupts_engines(healthy):
    c = healthy
    c.run("kept = 'still here'", display=False)
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(RemoteCellError) as ei:
        c.run("import time\nfor i in range(600):\n    time.sleep(0.1)", display=False)
    timer.join()
    assert time.monotonic() - t0 < 10
    assert "interrupted (Ctrl-C)" in ei.value.report
    assert c.pull("kept") == ["still here", "still here"]


def test_status_table(healthy):
    rows = healthy.status()
    assert [r["rank"] for r in rows] == [0, 1]
    for row, info in zip(rows, healthy.ranks):
        assert row["alive"] and row["state"] == "ok" and row["group"] is True
        assert row["pid"] == info.pid and row["backend"] == "gloo" and row["device"] == "cpu"
        assert row["rss_bytes"] > 10 * 2**20
    from dpnb.display import status_text

    text = status_text(rows)
    assert text.splitlines()[0].split()[:4] == ["rank", "host", "pid", "device"]
    assert str(healthy.ranks[1].pid) in text


def test_status_asks_the_engines_only_when_something_was_sent(healthy, monkeypatch):
    """Nothing sent since the last answers: the rows come back without a round trip."""
    c = healthy
    first = c.status()
    sent = []
    ask = c.transport.apply
    monkeypatch.setattr(c.transport, "apply", lambda *a, **k: sent.append(a) or ask(*a, **k))
    assert c.status() == first and sent == []
    c.run("grown = bytearray(64 * 2**20)", display=False)  # work sent: asked again
    after = c.status()
    assert len(sent) == 1 and after[0]["rss_bytes"] > first[0]["rss_bytes"] + 32 * 2**20
    c.run("del grown", display=False)


def test_bad_calls_leave_cluster_untouched(healthy):
    c = healthy
    c.run("sentinel = rank * 10", display=False)
    for bad in ("5", "x", "1:0", "-1", "0,,7"):
        with pytest.raises(DpnbError):
            c.run("print(1)", ranks=bad, display=False)
    with pytest.raises(DpnbError, match="valid Python names"):
        c.push({"not a name": 1})
    with pytest.raises(DpnbError, match="not defined on ranks 0-1"):
        c.pull("never_defined")
    assert c.pull("sentinel") == [0, 10]


def test_engine_death_is_reported_and_restart_restores_world(healthy):
    c = healthy
    c.run("survivor = rank + 100", display=False)
    old_pid = c.ranks[1].pid
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run("import os\nt = torch.ones(1)\nif rank == 1:\n    os._exit(7)\n"
              "dist.all_reduce(t)", display=False)
    took = time.monotonic() - t0
    err = ei.value
    # the death is seen when the process exits (its launcher says so), not when rank 0's
    # all_reduce gives up at the 6 s group timeout nor at the controller's missed heartbeats
    assert took < GROUP_TIMEOUT, f"{took:.1f} s: the death was not noticed at once"
    assert err.died == {1: "exit code 7"}
    assert "rank 1 died: exit code 7" in err.report
    assert "%dp restart" in err.report
    rows = c.status()
    assert rows[1]["alive"] is False and rows[0]["alive"] is True
    with pytest.raises(DpnbError, match="rank 1 died"):
        c.run("print(1)", display=False)
    msg = c.restart()
    assert "rank 1 replaced" in msg and "rank 0 keeps its state" in msg
    assert c.ranks[1].pid != old_pid and not c.dead
    res = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nv = (t.item(), "
                "globals().get('survivor'), rank, world_size)", display=False)
    assert res.ok
    assert c.pull("v") == [(2.0, 100, 0, 2), (2.0, None, 1, 2)]
