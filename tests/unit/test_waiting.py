"""How a cell's wait classifies ranks from their side-door answers (no cluster).

A rank that already failed and is only writing its error report (IPython
formatting the traceback, slow on a loaded machine) is neither a culprit nor
interrupted; ranks in Python code at the timeout are the culprits."""

import sys

from dpnb.cluster import waiting as W
from dpnb.cluster.types import WaitKind
from dpnb.engine import sidedoor

from helpers.waiting import FakeTransport


ANSWERS = {
    0: {"collective": {"op": "all_reduce"}, "reporting": False, "top": "wait"},
    1: {"collective": None, "reporting": True, "top": "render (core.py:394)"},
    2: {"collective": None, "reporting": False, "top": "sleep"},
}


def test_timeout_marks_the_rank_in_python_code_and_spares_the_reporting_one():
    t = FakeTransport(ANSWERS)
    w = W.Waiting(t, [0, 1, 2], "execute", timeout=9.0)
    w.step(w.t0 + 9.5)
    assert {r: o.status for r, o in w.outcomes.items()} == {0: "pending", 1: "pending", 2: "timeout"}
    assert t.interrupted == [{0, 2}]


def test_peer_failure_releases_but_a_reporting_rank_is_not_late():
    t = FakeTransport({0: ANSWERS[0], 1: ANSWERS[1], 2: ANSWERS[2], 3: ANSWERS[1]})
    w = W.Waiting(t, [0, 1, 2, 3], "execute", timeout=None)
    w.outcomes[3].status, w.outcomes[3].collective = "error", True
    w.pending.discard(3)
    w.step(w.t0 + 1.0)  # notices the failure
    w.step(w.t0 + 1.2)  # past the grace: release, classify the rest
    assert t.released and w.outcomes[2].status == "late" and w.outcomes[1].status == "pending"
    assert t.interrupted == [{2}]


def test_wait_lasts_longer_only_while_every_rank_left_is_reporting():
    t = FakeTransport(ANSWERS)
    w = W.Waiting(t, [1], "execute", timeout=None)
    w._capture_where()
    w.released, w.released_at = True, w.t0
    assert w.step(w.t0 + W.RELEASED_GRACE_S + 1) is False
    assert w.step(w.t0 + W.RELEASED_GRACE_S + W.REPORT_GRACE_S + 1) is True
    w2 = W.Waiting(FakeTransport(ANSWERS), [1, 2], "execute", timeout=None)
    w2._capture_where()
    w2.released, w2.released_at = True, w2.t0
    assert w2.step(w2.t0 + W.RELEASED_GRACE_S + 1) is True


def _frame_in(filename: str, name: str):
    """A real frame of a function called ``name`` compiled as if from ``filename``."""
    ns: dict = {"sys": sys}
    exec(compile(f"def {name}():\n    return sys._getframe()\n", filename, "exec"), ns)
    return ns[name]()


def test_reporting_is_read_from_ipython_frames_only():
    assert sidedoor._reporting(_frame_in("/x/IPython/core/interactiveshell.py", "showtraceback"))
    assert not sidedoor._reporting(_frame_in("/x/mycode.py", "showtraceback"))
    assert not sidedoor._reporting(sys._getframe())


FINISHING = {
    0: {"collective": None, "reporting": True, "in_cell": False, "top": "render"},
    1: {"collective": None, "reporting": False, "in_cell": False, "top": "flush"},
}


def _failed_elsewhere(t, kind=WaitKind.EXECUTE):
    w = W.Waiting(t, [0, 1, 2], kind, timeout=None)
    w.outcomes[2].status = "error"
    w.pending.discard(2)
    return w


def test_ranks_finishing_their_own_error_are_not_released_until_one_enters_the_cell():
    t = FakeTransport(dict(FINISHING))
    w = _failed_elsewhere(t)
    w.step(w.t0 + 1.0)
    w.step(w.t0 + 1.2)
    w.step(w.t0 + 1.25)  # within the poll interval: the last answer stands
    assert t.released == [] and t.interrupted == []
    # rank 1 had not started the cell: now it waits in a collective for rank 2
    t.answers[1] = {"collective": {"op": "all_reduce"}, "reporting": False, "in_cell": True,
                    "top": "wait"}
    w.step(w.t0 + 1.2 + W.FINISHING_POLL_S + 0.01)
    assert t.released and w.outcomes[0].status == "pending"


def test_finishing_ranks_are_released_after_the_bound_and_calls_release_at_once():
    t = FakeTransport(dict(FINISHING))
    w = _failed_elsewhere(t)
    w.step(w.t0 + 1.0)
    w.step(w.t0 + 1.2)
    assert not t.released
    w.step(w.t0 + 1.0 + W.FINISHING_MAX_S + 0.1)
    assert t.released
    t2 = FakeTransport(dict(FINISHING))
    w2 = _failed_elsewhere(t2, kind=WaitKind.APPLY)
    w2.step(w2.t0 + 1.0)
    w2.step(w2.t0 + 1.2)
    assert t2.released


def test_a_cell_done_within_the_death_poll_never_asks_for_deaths():
    """Issue 45: the first look for dead engines comes DEATH_POLL_S into the
    wait, not at its first wake-up (a `pass` cell at 16 ranks paid ~0.4 ms)."""
    w = W.Waiting(FakeTransport(ANSWERS), [0, 1, 2], WaitKind.EXECUTE, timeout=None)
    assert not w.time_to_look_for_deaths(w.t0 + 0.01)
    assert w.time_to_look_for_deaths(w.t0 + W.DEATH_POLL_S + 0.01)
    assert not w.time_to_look_for_deaths(w.t0 + W.DEATH_POLL_S + 0.02)


def test_a_frozen_rank_is_named_after_two_looks_and_only_its_peers_are_released():
    """Rank 2's process is stopped: seen at one look, named FROZEN once it stayed so
    for FROZEN_AFTER_S; then the others' groups are released and its side door --
    which a stopped process cannot answer -- is never knocked on; with only frozen
    ranks left, the wait ends at once instead of after the release's grace."""
    how = "its engine (PID 42) is stopped (SIGSTOP, Ctrl-Z or a job-control stop)"
    t = FakeTransport(ANSWERS, frozen={2: how})
    w = W.Waiting(t, [0, 1, 2], "execute", timeout=None)
    w.step(w.t0 + W.FROZEN_POLL_S)  # first seen stopped: not yet named
    assert w.outcomes[2].status == "pending" and not t.released
    w.step(w.t0 + W.FROZEN_POLL_S + W.FROZEN_AFTER_S)
    assert w.outcomes[2].status == "frozen" and w.outcomes[2].note == how
    assert t.released == [[0, 1]] and all(2 not in asked for asked in t.asked_where)
    w.pending -= {0, 1}  # the released ranks report back
    assert w.step(w.t0 + W.FROZEN_POLL_S + W.FROZEN_AFTER_S + 0.1) is True


def test_a_rank_stopped_and_continued_within_the_bound_is_not_frozen():
    t = FakeTransport(ANSWERS, frozen={2: "stopped"})
    w = W.Waiting(t, [0, 1, 2], "execute", timeout=None)
    w.step(w.t0 + W.FROZEN_POLL_S)
    t.stopped.clear()  # continued (job control, a brief debugger stop)
    w.step(w.t0 + W.FROZEN_POLL_S + W.FROZEN_AFTER_S)
    t.stopped[2] = "stopped"  # stopped again: the clock starts over
    w.step(w.t0 + 2 * W.FROZEN_POLL_S + W.FROZEN_AFTER_S)
    assert w.outcomes[2].status == "pending" and not t.released
