"""The notebook's DAP router (dpnb.session.dap): what goes to the ranks, what
to the kernel's debugpy, and how ids are translated -- ranks played by fakes
answering the side door's ``dap`` command."""

import asyncio
import types

import pytest

from dpnb.session import dap as dapmod


class FakeRanks:
    """Each rank's side door: a stack of one frame, one scope, one variable."""

    def __init__(self):
        self.asked = []

    def knock(self, addr, port, token, cmd, timeout=2.0, req=None):
        rank = port
        self.asked.append((rank, req["op"]))
        op = req["op"]
        if op == "state":
            return {"serial": 1, "stopped": True, "reason": "breakpoint"}
        if op == "stack":
            return {"frames": [{"frame": 0, "name": "<module>", "line": 3, "path": "/nb/cell.py"}]}
        if op == "scopes":
            return {"scopes": [{"name": "Globals", "ref": 1}]}
        if op == "variables":
            return {"variables": [{"name": "x", "value": str(rank * 10), "type": "int", "ref": 0}]}
        if op in dapmod.RANK_STEPS:
            return {"resumed": op}
        return {"error": f"unknown {op}"}


@pytest.fixture
def router(monkeypatch):
    ranks = FakeRanks()
    monkeypatch.setattr(dapmod.sidedoor, "knock", ranks.knock)
    cluster = types.SimpleNamespace(transport=types.SimpleNamespace(
        doors={0: ("door", 0), 1: ("door", 1)}, token="t"))
    kernel_calls = []

    async def kernel(msg):
        kernel_calls.append(msg["command"])
        body = {"threads": [{"id": 1, "name": "MainThread"}]} if msg["command"] == "threads" else {}
        return {"type": "response", "success": True, "command": msg["command"], "body": body}

    r = dapmod.DapRouter(kernel, lambda e: None, lambda: cluster)
    r.kernel_calls, r.fake, r.c = kernel_calls, ranks, cluster
    return r


def _ask(router, command, **args):
    return asyncio.run(router.handle({"seq": 7, "type": "request", "command": command,
                                      "arguments": args}))


def test_the_ranks_threads_exist_only_while_a_debugged_cell_runs(router):
    assert [t["id"] for t in _ask(router, "threads")["body"]["threads"]] == [1]
    router.cell_ranks = (0, 1)
    names = [t["name"] for t in _ask(router, "threads")["body"]["threads"]]
    assert names == ["MainThread", "rank 0 · MainThread", "rank 1 · MainThread"]


def test_a_ranks_frames_and_variables_are_asked_of_that_rank_under_ids_of_our_own(router):
    router.cell_ranks = (0, 1)
    st = _ask(router, "stackTrace", threadId=dapmod.THREAD_BASE + 1)
    frame = st["body"]["stackFrames"][0]
    assert frame["id"] >= dapmod.ID_BASE and frame["source"]["path"] == "/nb/cell.py"
    scope = _ask(router, "scopes", frameId=frame["id"])["body"]["scopes"][0]
    got = _ask(router, "variables", variablesReference=scope["variablesReference"])
    assert [(v["name"], v["value"]) for v in got["body"]["variables"]] == [("x", "10")]
    assert "stackTrace" not in router.kernel_calls and "variables" not in router.kernel_calls


def test_the_kernels_own_requests_go_to_debugpy(router):
    router.cell_ranks = (0, 1)
    _ask(router, "stackTrace", threadId=1)
    _ask(router, "variables", variablesReference=5)
    assert router.kernel_calls == ["stackTrace", "variables"] and router.fake.asked == []


def test_breakpoints_are_kept_by_path_and_the_debugger_is_on_once_attached(router):
    assert router.cell("/nb/cell.py", 1) is None  # off: no flag on the cell
    _ask(router, "initialize")
    _ask(router, "setBreakpoints", source={"path": "/nb/cell.py"}, breakpoints=[{"line": 3}])
    cell = router.cell("/nb/cell.py", 1)
    assert cell.breaks == (("/nb/cell.py", (3,)),) and cell.shift == 1
    _ask(router, "setBreakpoints", source={"path": "/nb/cell.py"}, breakpoints=[])
    assert router.cell("/nb/cell.py", 1).breaks == ()


def test_continue_moves_one_rank_and_disconnect_resumes_every_stopped_one(router):
    router.cell_ranks, router.on = (0, 1), True
    router.stopped = {0, 1}
    r = _ask(router, "continue", threadId=dapmod.THREAD_BASE + 1)
    assert r["success"] and r["body"] == {"allThreadsContinued": False}
    assert router.stopped == {0} and (1, "continue") in router.fake.asked
    _ask(router, "disconnect")
    assert router.stopped == set() and (0, "continue") in router.fake.asked and not router.on


def test_a_rank_that_cannot_answer_fails_that_request_with_its_words(router, monkeypatch):
    router.cell_ranks = (0, 1)
    monkeypatch.setattr(dapmod.sidedoor, "knock", lambda *a, **k: {"error": "rank 1 is running, not stopped"})
    r = _ask(router, "stackTrace", threadId=dapmod.THREAD_BASE + 1)
    assert not r["success"] and r["message"] == "rank 1 is running, not stopped"


def test_jupyterlabs_continue_moves_every_stopped_rank_whatever_thread_it_names(router):
    """Lab drops the shown thread from its stopped set before naming one: a lone
    stopped rank's Continue arrives for thread 1 (the kernel's)."""
    _ask(router, "initialize", clientID="jupyterlab")
    router.cell_ranks, router.stopped = (0, 1), {1}
    r = _ask(router, "continue", threadId=1)
    assert r["success"] and r["body"] == {"allThreadsContinued": True}
    assert (1, "continue") in router.fake.asked and router.stopped == set()
    assert "continue" not in router.kernel_calls
    router.stopped = {0, 1}
    _ask(router, "continue", threadId=dapmod.THREAD_BASE)
    assert router.stopped == set() and router.fake.asked.count((0, "continue")) == 1


def test_another_clients_continue_on_a_running_rank_is_a_no_op(router):
    router.cell_ranks, router.stopped = (0, 1), {0}
    r = _ask(router, "continue", threadId=dapmod.THREAD_BASE + 1)
    assert r["success"] and router.fake.asked == [] and router.stopped == {0}
