"""The pure parts of running users' own code: certain deadlocks, the user's line in
reports, torchrun's lifecycle calls, %dp run's script namespace, pdb's channel."""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest

from dpnb.cluster import deadlock
from dpnb.cluster.diagnose import classify, kept, remote_error, user_line, where_verdict
from dpnb.cluster.types import CellResult, RankOutcome


def _coll(op="all_reduce", group=None, phase="run", index=None, peer=None, awaiting=None, seq=1):
    return {"collective": {"op": op, "group": group, "phase": phase, "index": index,
                           "peer": peer, "awaiting": awaiting, "seq": seq}}


# ------------------------------------------------------------------ deadlock
def test_a_collective_a_finished_rank_belongs_to_is_a_certain_deadlock():
    answers = {1: _coll()}
    assert deadlock.certain(answers, {1}, 2) == {1: "rank 0 of its group will not join it "
                                                    "(not running the cell)"}
    # a subgroup without the finished rank may still complete
    assert deadlock.certain({1: _coll(group=[1, 2]), 2: {}}, {1, 2}, 3) == {}
    assert deadlock.certain({1: _coll(group=[1, 2])}, {1}, 3)


def test_a_rank_in_python_code_or_pdb_keeps_everyone_waiting():
    assert deadlock.certain({1: _coll(), 2: {"collective": None}}, {1, 2}, 3) == {}
    assert deadlock.certain({1: dict(_coll(), debugger={"at": "cell line 2"})}, {1}, 2) == {}
    assert deadlock.certain({1: None}, {1}, 2) == {}  # no answer: not proof of anything


def test_point_to_point_waits_on_its_peer_only():
    assert deadlock.certain({1: _coll(op="recv", peer=0)}, {1}, 3)
    assert deadlock.certain({1: _coll(op="recv", peer=2), 2: {}}, {1, 2}, 3) == {}
    assert deadlock.certain({1: _coll(op="recv", peer=None)}, {1}, 2)  # any source: all idle


def test_a_checker_waiting_on_a_rank_that_ran_the_call_unchecked_is_stuck():
    answers = {0: _coll(phase="check", index=7, awaiting=[1]), 1: _coll(phase="run", index=7)}
    why = deadlock.certain(answers, {0, 1}, 2)
    assert why == {0: "it is checking call #7 while rank 1 runs that call without the check",
                   1: "it runs call #7 without the check while rank 0 is still checking it"}
    # the same index but still checking on both sides is just a check in progress
    answers[1] = _coll(phase="check", index=7, awaiting=[0])
    assert deadlock.certain(answers, {0, 1}, 2) == {}
    # and a peer past its check (its verdict in) is not waiting on anyone
    answers = {0: _coll(phase="check", index=7, awaiting=None), 1: _coll(phase="run", index=7)}
    assert deadlock.certain(answers, {0, 1}, 2) == {}


def test_two_looks_must_see_the_same_calls():
    a = {1: _coll(seq=1)}
    b = {1: _coll(seq=2)}
    assert deadlock.signature(a, {1}) != deadlock.signature(b, {1})


# ------------------------------------------------------------------ reports
def _res(**outs):
    oc = {int(k[1:]): RankOutcome(rank=int(k[1:]), **v) for k, v in outs.items()}
    return CellResult(ranks=sorted(oc), outcomes=oc, elapsed_s=0.4)


def test_user_line_is_the_innermost_frame_of_a_cell_or_of_the_users_file():
    tb = ("Cell In[7], line 1\n----> 1 __import__('dpnb.engine.cell.script').run(...)\n\n"
          "File /home/u/proj/train.py:40, in main()\n     39 x = 1\n---> 40 loss.backward()\n\n"
          "File /venv/lib/python3.11/site-packages/torch/_tensor.py:625, in backward\n"
          "--> 625 torch.autograd.backward()\n")
    # the file by its path (below the current folder: relative), never its bare name
    assert user_line(tb) == "/home/u/proj/train.py line 40: loss.backward()"
    here = os.path.join(os.getcwd(), "a", "utils.py")
    assert user_line(f"File {here}:83, in f()\n---> 83 g()\n") == "a/utils.py line 83: g()"
    cell = "Cell In[3], line 4\n----> 4 f(rank)\n\nCell In[3], line 3, in f(z)\n----> 3 raise E\n"
    assert user_line(cell) == "cell line 3: raise E"


def test_exits_read_as_exits_not_crashes():
    res = _res(r0=dict(status="error", ename="SystemExit", evalue="3"),
               r1=dict(status="error", ename="ScriptExit",
                       evalue="train.py exited with status 2"))
    err = remote_error(res, classify(res), timeout_s=30, reform_msg="", reformed=False)
    assert "rank 0: exit() / sys.exit(3) ended the cell there; the engine keeps running" in err.report
    assert "rank 1: train.py exited with status 2" in err.report
    assert "raised" not in err.report


def test_a_released_deadlock_names_the_stuck_rank_and_why():
    res = _res(r0=dict(status="ok"), r1=dict(status="deadlocked", ename="CheckReleased",
                                             collective=True, note="rank 0 will not join it"))
    res.released = True
    d = classify(res)
    assert d.culprits == [1] and d.needs_reform
    err = remote_error(res, d, timeout_s=30, reform_msg="", reformed=True)
    assert err.summary.startswith("rank 1 blocked in a collective no rank could join")
    assert "rank 1 could never complete its collective: rank 0 will not join it" in err.report


def test_where_names_the_users_line_and_the_library_below_it():
    res = _res(r0=dict(status="timeout"), r1=dict(status="timeout"))
    res.where = {0: {"running": True, "user_line": "cell line 4", "cell_line": 4,
                     "inside": "torch.distributed.checkpoint", "top": "is_stmt (util.py:180)"},
                 1: {"running": False, "selected": False, "cell_calls": {}}}
    assert where_verdict(res) == ("rank 0 is running Python code at cell line 4, inside "
                                  "torch.distributed.checkpoint")


def test_kept_never_prints_an_empty_rank_list():
    assert kept([]) == "no rank survived, so nothing on the engines was kept"
    assert kept([1]) == "rank 1 keeps its state"


# ------------------------------------------------------------------ frames
def test_frames_tell_cells_and_user_files_from_libraries():
    from dpnb.engine.debugging import frames

    assert frames.is_cell("/tmp/ipykernel_123/456.py") and not frames.is_library("<ipython-input-3>")
    assert frames.is_library(os.__file__) and frames.is_library(frames.__file__)
    assert not frames.is_library("/home/u/proj/train.py")
    ns: dict = {}
    exec(compile("import sys\ndef f():\n    return sys._getframe()\n", "/home/u/t.py", "exec"), ns)
    hit = frames.user_frame(ns["f"]())
    assert hit is not None and hit[2] == "/home/u/t.py line 3"


# ------------------------------------------------------------------ lifecycle
def test_init_process_group_is_adopted_only_when_it_asks_for_this_group():
    from dpnb.engine.group.lifecycle import _differences

    st = types.SimpleNamespace(backend="gloo", world_size=2, rank=1)
    assert _differences(st, "gloo", -1, -1) == []
    assert _differences(st, None, 2, 1) == []
    assert _differences(st, "cpu:gloo,cuda:nccl", -1, -1) == []
    assert _differences(st, "nccl", 4, 0) == [
        "backend 'nccl' (the cluster's group is gloo)",
        "world_size=4 (the cluster has 2 ranks)", "rank=0 (this engine is rank 1)"]


# ------------------------------------------------------------------ %dp run
def test_a_script_runs_as_main_with_its_argv_and_leaves_its_globals(tmp_path):
    from dpnb.engine.cell.script import ScriptExit, run

    path = str(tmp_path / "job.py")
    src = ("import sys, argparse\nimport helper\n"
           "p = argparse.ArgumentParser()\np.add_argument('--n', type=int)\n"
           "args = p.parse_args()\nresult = (__name__, args.n, helper.VALUE, sys.argv[0])\n"
           "if args.n == 0:\n    sys.exit(0)\nif args.n < 0:\n    sys.exit(4)\n")
    (tmp_path / "helper.py").write_text("VALUE = 'from the script folder'\n")
    ns = {"exit": "the rank's own", "rank": 0}
    argv, path0 = list(sys.argv), list(sys.path)
    run(ns, path, ["--n", "3"], src)
    assert ns["result"] == ("__main__", 3, "from the script folder", path)
    assert ns["exit"] == "the rank's own" and "__name__" not in ns
    assert sys.argv == argv and sys.path == path0  # restored
    run(ns, path, ["--n", "0"], src)  # sys.exit(0): a normal end
    with pytest.raises(ScriptExit, match="job.py exited with status 4"):
        run(ns, path, ["--n", "-1"], src)
    with pytest.raises(ScriptExit, match="status 2"):  # argparse's error exit
        run(ns, path, ["--n", "x"], src)
    assert sys.argv == argv and sys.path == path0
    sys.modules.pop("helper", None)


# ------------------------------------------------------------------ pdb
def test_the_rank_debugger_publishes_its_prompt_and_runs_the_lines_it_is_fed(monkeypatch):
    import ipyparallel.datapub

    from dpnb.engine.debugging import rankpdb

    published = []
    monkeypatch.setattr(ipyparallel.datapub, "publish_data", lambda d: published.append(d))
    st = types.SimpleNamespace(rank=1, debugger=None, debug_detached=False, debug_used=False)
    out = {}

    def user_code():
        x = 41
        rankpdb._stop_here(st, sys._getframe())
        out["y"] = x + 1

    def feeder():  # the notebook's part, from another thread
        lines, seen = ["p x * 2", "x = 99", "c"], 0
        deadline = threading.Event()
        while lines and not deadline.wait(0.01):
            dbg = st.debugger
            if len(published) > seen and dbg is not None and dbg.chan.prompting:
                seen = len(published)
                rankpdb.feed(st, lines.pop(0))

    t = threading.Thread(target=feeder, daemon=True)
    t.start()
    user_code()  # pdb stops on the main thread, as on an engine
    t.join(5)
    texts = [d[rankpdb.DATA_KEY]["text"] for d in published]
    assert texts[0].endswith("(Pdb rank 1) ") and "82" in texts[1]
    assert out["y"] == 100  # the fed assignment changed the rank's variable
    assert st.debugger is None and not rankpdb.feed(st, "c")


def test_the_desk_tells_a_rank_to_go_on_where_nobody_can_answer(monkeypatch, capsys):
    from dpnb.cluster import debugging

    sent = []
    monkeypatch.setattr("dpnb.cluster.sidedoor.knock",
                        lambda *a, **kw: sent.append(kw.get("line", "?")) or {"fed": True})
    md = {"data": {"dpnb_pdb": {"n": 1, "text": "> cell(2)\n(Pdb rank 0) "}}}
    ar = types.SimpleNamespace(_metadata=[md])
    t = types.SimpleNamespace(doors={0: ("127.0.0.1", 1)}, token="x", timeout_s=30.0,
                              where=lambda ranks: {})
    desk = debugging.Desk(t, lambda prompt: None)
    desk.poll({0: ar}, {0})
    assert sent == [None] and "cannot prompt" in capsys.readouterr().out
    md["data"]["dpnb_pdb"] = {"n": 2, "text": "(Pdb rank 0) "}
    assert desk.poll({0: ar}, {0}) == 0.0 and sent == [None, None]  # said once only
    desk2 = debugging.Desk(t, debugging.scripted(["p 1"]))
    md["data"]["dpnb_pdb"] = {"n": 1, "text": "(Pdb rank 0) "}
    desk2.poll({0: ar}, {0})
    assert sent[-1] == "p 1"


def test_ctrl_c_at_a_pdb_prompt_quits_that_ranks_debugger_and_stops_the_cell(monkeypatch):
    """Ctrl-C in the input box: the rank stopped in pdb is told to quit (else it
    would sit at its prompt with nobody to answer), and the interrupt goes on
    to stop the cell as any Ctrl-C does."""
    from dpnb.cluster import debugging

    sent = []
    monkeypatch.setattr("dpnb.cluster.sidedoor.knock",
                        lambda *a, **kw: sent.append((a[3], kw.get("line"))) or {"fed": True})
    md = {"data": {"dpnb_pdb": {"n": 1, "text": "> cell(2)\n(Pdb rank 1) "}}}
    t = types.SimpleNamespace(doors={1: ("127.0.0.1", 1)}, token="x", timeout_s=30.0,
                              where=lambda ranks: {})

    def ctrl_c(prompt):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        debugging.Desk(t, ctrl_c).poll({1: types.SimpleNamespace(_metadata=[md])}, {1})
    assert sent == [("pdb", "q")]


def test_native_log_lines_leave_the_output_for_the_log():
    from dpnb.cluster.render import without_native_logs

    text = ("hello\n[W1123 21:12:00.962000 2835 ProcessGroupGloo.cpp:165] Warning: x\n"
            "I1123 21:12:00.9620 2835 pair.cc:45] Rank 1 successfully reached monitoredBarrier\n"
            "bye [0]\n")
    assert without_native_logs(text) == "hello\nbye [0]\n"
