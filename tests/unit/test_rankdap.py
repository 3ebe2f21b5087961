"""A rank's side of JupyterLab's debugger (dpnb.engine.debugging.rankdap), in
one process: a "cell" compiled under an engine-style file name runs on a
thread (tracing is per thread, as on a rank's main thread) while this test
plays the side door's thread."""

import threading
import time

import pytest

from dpnb.core.cellflags import DapCell, dap_cell, dap_flag, with_flags
from dpnb.engine.debugging import rankdap

ENGINE_FILE = "/tmp/ipykernel_1/123.py"  # frames.is_cell: an ipykernel cell file
NOTEBOOK_PATH = "/tmp/ipykernel_9/456.py"  # the path JupyterLab knows the cell by


def _cell(dap, code, ns, lines=(3,)):
    """Run ``code`` as a rank would after its pre_run_cell hook (breakpoints at the
    notebook's ``lines``); errors kept."""
    out = {}

    def go():
        try:
            dap.begin(ENGINE_FILE, DapCell(NOTEBOOK_PATH, 1, ((NOTEBOOK_PATH, tuple(lines)),)))
            try:
                exec(compile(code, ENGINE_FILE, "exec"), ns)
            finally:
                dap.end()
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def _wait_stopped(dap, serial, timeout=4):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = dap.state()
        if s["stopped"] and s["serial"] > serial:
            return s
        time.sleep(0.01)
    raise AssertionError(f"no stop within {timeout} s: {dap.state()}")


def test_the_flag_round_trips_and_a_malformed_one_is_ignored():
    cell = DapCell(NOTEBOOK_PATH, 1, ((NOTEBOOK_PATH, (3, 7)),))
    assert dap_cell(with_flags("x = 1", (dap_flag(cell),))) == cell
    assert dap_cell("x = 1\n# dpnb: --dap {not json") is None
    assert dap_cell("x = 1") is None


def test_a_breakpoint_stops_at_the_notebooks_line_with_the_cells_variables():
    dap = rankdap.RankDap(rank=1)
    ns = {"rank": 1}
    # notebook line 3 is the engine's line 2 (the %%dp line comes first in the notebook)
    t, out = _cell(dap, "x = rank * 10\ny = x + 1\nz = y", ns)
    s = _wait_stopped(dap, 0)
    assert s["reason"] == "breakpoint"
    top = dap.ask({"op": "stack"})["frames"][0]
    assert (top["line"], top["path"], top["cell"]) == (3, NOTEBOOK_PATH, True)
    scopes = dap.ask({"op": "scopes", "frame": 0})["scopes"]
    names = {v["name"]: v["value"] for v in
             dap.ask({"op": "variables", "ref": scopes[-1]["ref"]})["variables"]}
    assert names["x"] == "10" and "y" not in names
    assert dap.ask({"op": "evaluate", "frame": 0, "expression": "x * 2"})["result"] == "20"
    assert dap.ask({"op": "continue"}) == {"resumed": "continue"}
    t.join(10)
    assert not t.is_alive() and "error" not in out and ns["z"] == 11


def test_next_stops_at_the_next_line_and_a_running_rank_refuses_requests():
    dap = rankdap.RankDap(rank=0)
    ns = {"rank": 0}
    t, out = _cell(dap, "a = 1\nb = a + 1\nc = b + 1\nd = c", ns)
    _wait_stopped(dap, 0)
    dap.ask({"op": "next"})
    s = _wait_stopped(dap, 1)
    assert s["reason"] == "step" and dap.ask({"op": "stack"})["frames"][0]["line"] == 4
    dap.ask({"op": "continue"})
    t.join(10)
    assert not t.is_alive() and ns["d"] == 3
    assert "running" in dap.ask({"op": "stack"})["error"]


def test_a_breakpoint_in_a_function_stops_in_it_and_the_stack_reaches_the_cell():
    dap = rankdap.RankDap(rank=0)
    ns = {}
    code = "def f(v):\n    w = v + 1\n    return w\nout = f(41)"
    t, out = _cell(dap, code, ns)  # notebook line 3 = the function's `w = v + 1`
    _wait_stopped(dap, 0)
    frames = dap.ask({"op": "stack"})["frames"]
    assert [(f["name"], f["line"]) for f in frames[:2]] == [("f", 3), ("<module>", 5)]
    scopes = dap.ask({"op": "scopes", "frame": 0})["scopes"]
    assert scopes[0]["name"] == "Locals"
    loc = {v["name"]: v["value"] for v in dap.ask({"op": "variables", "ref": scopes[0]["ref"]})["variables"]}
    assert loc == {"v": "41"}
    dap.ask({"op": "continue"})
    t.join(10)
    assert ns["out"] == 42


def test_no_breakpoint_in_the_cell_means_no_tracing():
    dap = rankdap.RankDap(rank=0)
    dap.begin(ENGINE_FILE, DapCell(NOTEBOOK_PATH, 1, (("/elsewhere.py", (3,)),)))
    try:
        assert not dap.tracing
    finally:
        dap.end()


@pytest.mark.parametrize("op", ["variables", "scopes"])
def test_a_bad_reference_is_an_error_for_that_request_not_the_stop(op):
    dap = rankdap.RankDap(rank=0)
    t, out = _cell(dap, "x = 1\ny = 2\nz = 3", {})
    _wait_stopped(dap, 0)
    got = dap.ask({"op": op, "ref": 99, "frame": 99})
    assert "error" in got and dap.state()["stopped"]
    dap.ask({"op": "continue"})
    t.join(10)
    assert not t.is_alive()


def test_step_in_enters_a_function_and_step_out_returns_to_the_cell():
    dap = rankdap.RankDap(rank=0)
    ns = {}
    code = "def f(v):\n    w = v + 1\n    return w\nout = f(1)\nlast = out"
    t, out = _cell(dap, code, ns, lines=(5,))  # notebook line 5: `out = f(1)`
    _wait_stopped(dap, 0)
    dap.ask({"op": "stepIn"})
    _wait_stopped(dap, 1)
    top = dap.ask({"op": "stack"})["frames"][0]
    assert (top["name"], top["line"]) == ("f", 3)  # inside f, at `w = v + 1`
    dap.ask({"op": "stepOut"})
    _wait_stopped(dap, 2)
    top = dap.ask({"op": "stack"})["frames"][0]
    assert (top["name"], top["line"]) == ("<module>", 6) and ns["out"] == 2
    dap.ask({"op": "continue"})
    t.join(10)
    assert not t.is_alive() and ns["last"] == 2


def test_continue_keeps_the_breakpoint_for_the_next_pass_of_a_loop():
    dap = rankdap.RankDap(rank=0)
    ns = {}
    t, out = _cell(dap, "for i in range(2):\n    v = i\ndone = True", ns)  # notebook 3: `v = i`
    _wait_stopped(dap, 0)
    dap.ask({"op": "continue"})
    _wait_stopped(dap, 1)  # the second pass stops again
    names = {v["name"]: v["value"] for v in dap.ask({"op": "variables", "ref": dap.ask(
        {"op": "scopes", "frame": 0})["scopes"][-1]["ref"]})["variables"]}
    assert names["i"] == "1"
    dap.ask({"op": "continue"})
    t.join(10)
    assert not t.is_alive() and ns["done"]
