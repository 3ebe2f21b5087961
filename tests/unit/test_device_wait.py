"""Issue 29, defect 6: under NCCL a rank waiting for a peer is in a device
synchronize, not in a c10d frame (the all-reduce was only queued on its GPU).

``%dp where`` and ``--timeout`` used to call such ranks culprits ("running
Python code") and SIGINT them; the rank that never came went unnamed.  Here a
thread sits in a function named and filed as torch's ``synchronize`` while
the device is said to have queued work (the one thing not real: no GPU)."""

from __future__ import annotations

import sys
import threading
import time
import types

import torch

from dpnb.cluster import deadlock
from dpnb.cluster import waiting as W
from dpnb.cluster.diagnose import where_verdict
from dpnb.cluster.types import CellResult, RankOutcome
from dpnb.engine import device
from dpnb.engine import sidedoor

from helpers.waiting import FakeTransport

# blocks in C (a lock), as torch's synchronize blocks in its C call
_SRC = "def synchronize(lock):\n    lock.acquire(timeout=10)\n"


def _blocked_in_torch_synchronize():
    """A thread inside ``synchronize`` of ``.../torch/cuda/__init__.py``."""
    code = compile(_SRC, "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", "exec")
    mod: dict = {}
    exec(code, mod)
    lock = threading.Lock()
    lock.acquire()
    t = threading.Thread(target=mod["synchronize"], args=(lock,), daemon=True)
    t.start()
    while t.ident is None or sys._current_frames().get(t.ident) is None:
        time.sleep(0.01)
    return t, lock


def _state(backend, mark="a collective's event"):
    return types.SimpleNamespace(rank=1, backend=backend, device=torch.device("cuda", 0),
                                 current_collective=None, debugger=None, cell_calls={},
                                 collective_mark=mark)


class _Event:
    """What ``device.mark_collective`` records: ``query()`` is whether the
    stream has passed it (the collective before it completed)."""

    def __init__(self, passed):
        self.passed = passed

    def query(self):
        return self.passed


def test_an_nccl_rank_waiting_on_its_gpu_is_inside_a_collective(monkeypatch):
    monkeypatch.setattr(device, "queued_work", lambda dev: True)  # the stream is busy throughout
    t, release = _blocked_in_torch_synchronize()
    try:
        pending = _state("nccl", _Event(passed=False))  # the last collective has not completed
        a = sidedoor.where(pending, ident=t.ident)
        assert a["collective"] == {"op": "device synchronize", "group": None, "device_wait": True}
        # the collective completed: what is queued now is the rank's own compute
        assert sidedoor.where(_state("nccl", _Event(passed=True)), ident=t.ident)[
            "collective"] is None
        # no collective issued at all (a cell of matmuls and a synchronize)
        assert sidedoor.where(_state("nccl", None), ident=t.ident)["collective"] is None
        # gloo's collectives are seen in their c10d frames instead
        assert sidedoor.where(_state("gloo", _Event(passed=False)), ident=t.ident)[
            "collective"] is None
    finally:
        release.release()
        t.join()


def _where_in_synchronize(mark) -> dict:
    """The side door's answer for an NCCL rank in ``torch.cuda.synchronize()``
    whose last marked collective is ``mark`` (passed or not)."""
    t, release = _blocked_in_torch_synchronize()
    try:
        return dict(sidedoor.where(_state("nccl", mark), ident=t.ident), reporting=False)
    finally:
        release.release()
        t.join()


def test_timeout_spares_the_rank_waiting_on_its_gpu_and_names_the_other(monkeypatch):
    waiting = _where_in_synchronize(_Event(passed=False))
    culprit = {"collective": None, "reporting": False, "top": "sleep"}
    tr = FakeTransport({0: culprit, 1: waiting})
    w = W.Waiting(tr, [0, 1], "execute", timeout=9.0)
    w.step(w.t0 + 9.5)
    assert {r: o.status for r, o in w.outcomes.items()} == {0: "timeout", 1: "pending"}
    # rank 0 finished instead: rank 1's wait can never end, known without a timeout
    assert deadlock.certain({1: waiting}, {1}, 2) == {
        1: "rank 0 of its group will not join it (not running the cell)"}
    res = CellResult(ranks=[0, 1], outcomes={0: RankOutcome(rank=0, status="ok"),
                                             1: RankOutcome(rank=1, status="timeout")},
                     elapsed_s=1.0)
    res.where = {0: {"running": False, "cell_calls": {}, "collective": None},
                 1: dict(waiting, running=True, cell_line=7, user_line=None)}
    assert where_verdict(res) == (
        "rank 1 is waiting for its GPU's queued work (a device synchronize; under NCCL, most "
        "likely a collective a peer has not joined) at cell line 7; rank 0 finished the cell")


def test_a_rank_synchronizing_behind_its_own_compute_is_running_not_deadlocked(monkeypatch):
    """Issue 38, defect C: rank 0 finished the cell, rank 1 sits in
    ``torch.cuda.synchronize()`` behind plain matmuls (evaluation, timing):
    its stream has queued work, but no collective of its is unfinished, so it
    is no certain deadlock (which would abort every rank's communicators)."""
    monkeypatch.setattr(device, "queued_work", lambda dev: True)
    busy = _where_in_synchronize(_Event(passed=True))
    assert busy["collective"] is None
    assert deadlock.certain({1: busy}, {1}, 2) == {}


def test_the_cell_guard_marks_each_collective_it_passes_under_nccl(monkeypatch):
    from dpnb.engine.cell import cellguard

    marks = []
    monkeypatch.setattr(device, "mark_collective", lambda dev: marks.append(dev) or "event")
    g = cellguard.Guard(types.SimpleNamespace(device="cuda:0", collective_mark=None))
    w = cellguard._wrapped(g, "all_reduce", lambda tensor, group=None, async_op=False: "done")
    assert w("t") == "done" and marks == []  # gloo: nothing to mark
    g.nccl = True
    assert w("t") == "done" and marks == ["cuda:0"]
    assert g.state.collective_mark == "event"
