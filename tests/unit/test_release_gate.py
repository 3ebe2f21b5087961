"""A release under NCCL, in the order and with the bookkeeping a CPU can check.

No GPU here: the works and the abort are fakes; what is checked is dpnb's
own logic -- the side door counts the release and aborts before it shuts
sockets, a second abort does not leave the door unanswered, and a training
step whose gradient sync was released refuses its optimizer step even when
the release lands while the step waits for the device.
"""

from types import SimpleNamespace

import pytest

from dpnb import compat
from dpnb.engine import sidedoor
from dpnb.engine.train import step
from dpnb.engine.train.train_state import TrainError


def test_gate_passes_a_quiet_step_and_refuses_a_released_one():
    es = SimpleNamespace(releases=3)
    step.optimizer_gate(es, 3, "cpu")
    es.releases = 4
    with pytest.raises(TrainError, match="optimizer step was not applied"):
        step.optimizer_gate(es, 3, "cpu")


def test_gate_checks_after_waiting_for_the_device(monkeypatch):
    es = SimpleNamespace(releases=0, backend="nccl")

    def sync(_dev):  # the abort lands while the all-reduce kernel is still running
        es.releases += 1

    monkeypatch.setattr(step.device, "synchronize", sync)
    with pytest.raises(TrainError):
        step.optimizer_gate(es, 0, "cuda:0")


def test_release_counts_then_aborts_before_shutting_sockets(monkeypatch):
    calls = []
    monkeypatch.setattr(compat, "abort_groups", lambda: calls.append("abort") or True)
    monkeypatch.setattr(sidedoor, "release_connections",
                        lambda keep, me: calls.append("shut") or 2)
    door = sidedoor.SideDoor.__new__(sidedoor.SideDoor)  # no socket: release() only
    door.state, door.keep = SimpleNamespace(backend="nccl", releases=0), set()
    out = door.release(("127.0.0.1", 1), ("127.0.0.1", 2))
    assert calls == ["abort", "shut"] and out == {"aborted": True, "released": 2}
    assert door.state.releases == 1
    door.state.backend = "gloo"  # gloo: nothing to abort, the sockets are the release
    calls.clear()
    door.release("/path", "")
    assert calls == ["shut"] and door.state.releases == 2


def test_a_second_abort_is_reported_not_raised(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    def gone():
        raise ValueError("Default process group has not been initialized")

    monkeypatch.setattr(c10d, "_abort_process_group", gone)
    assert compat.abort_groups() is False


def test_gate_waits_for_the_device_only_under_nccl(monkeypatch):
    waited = []
    monkeypatch.setattr(step.device, "synchronize", waited.append)
    step.optimizer_gate(SimpleNamespace(releases=0, backend="gloo"), 0, "cuda:0")
    assert waited == []  # gloo raises in the all-reduce itself: no stall per step
    step.optimizer_gate(SimpleNamespace(releases=0, backend="nccl"), 0, "cuda:0")
    assert waited == ["cuda:0"]


class _FakeNcclBackend:
    """What ``pg._get_backend(cuda)`` returns under NCCL: ``get_error()``
    gives the error the watchdog recorded (an enum with ``.name``)."""

    def __init__(self):
        self.error = "SUCCESS"

    def get_error(self):
        return SimpleNamespace(name=self.error)


class _FakeGroup:
    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, dev):
        if dev.type != "cuda":
            raise RuntimeError("No backend type associated with device type cpu")
        if self.backend is None:
            raise RuntimeError("No backend type associated with device type cuda")
        return self.backend


def test_gate_refuses_a_step_after_the_watchdogs_abort(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    backend = _FakeNcclBackend()
    monkeypatch.setattr(c10d._world, "_default_pg", _FakeGroup(backend))  # what WORLD reads
    es = SimpleNamespace(releases=0, backend="nccl")

    def sync(_dev):  # the group timeout passes while the all-reduce kernel waits
        backend.error = "TIMEOUT"

    monkeypatch.setattr(step.device, "synchronize", lambda _dev: None)
    step.optimizer_gate(es, 0, "cuda:0")  # a quiet step: no release, no watchdog error
    monkeypatch.setattr(step.device, "synchronize", sync)
    with pytest.raises(TrainError, match="watchdog aborted the process group \\(TIMEOUT"):
        step.optimizer_gate(es, 0, "cuda:0")
    assert es.releases == 0  # no side-door release: the watchdog alone refused the step


def test_group_error_is_none_without_an_nccl_side(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setattr(c10d._world, "_default_pg", None)  # after a release: no group
    assert compat.group_error() is None
    assert compat.group_error(_FakeGroup(None)) is None  # gloo: no CUDA backend
    assert compat.group_error(_FakeGroup(object())) is None  # a backend without get_error
    nccl = _FakeNcclBackend()
    assert compat.group_error(_FakeGroup(nccl)) is None
    nccl.error = "COMM_ERROR"
    assert compat.group_error(_FakeGroup(nccl)) == "COMM_ERROR"


def test_a_group_the_watchdog_aborted_is_aborted_not_shut_down(monkeypatch):
    """``destroy_process_group`` of a communicator torch's watchdog aborted sat
    in ~ProcessGroupNCCL's join of the sleeping watchdog on an H200 (gpu_check
    part B): the re-form aborts it and hands the group to a side thread."""
    import torch.distributed as dist

    from dpnb.engine import setup

    calls, retired = [], []
    world = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=world))
    monkeypatch.setattr(setup, "user_ns", lambda: {})
    monkeypatch.setattr(setup, "torch_fn", lambda name: lambda: calls.append(name))
    monkeypatch.setattr(setup, "retire_group", retired.append)
    monkeypatch.setattr(compat, "abort_groups", lambda: calls.append("abort") or True)
    monkeypatch.setattr(compat, "group_error", lambda pg=None: None)
    assert setup.destroy_group() and calls == ["destroy_process_group"] and not retired
    calls.clear()
    monkeypatch.setattr(compat, "group_error", lambda pg=None: "TIMEOUT")
    assert setup.destroy_group() and calls == ["abort"] and retired == [world]


def test_a_retired_group_dies_on_the_side_thread_once_it_holds_the_last_reference():
    import threading
    import time

    from dpnb.engine import setup

    died = []

    class Group:  # stands for a ProcessGroup whose destructor joins torch's watchdog
        def __del__(self):
            died.append(threading.current_thread().name)

    g = Group()
    setup.retire_group(g)
    time.sleep(0.5)
    assert died == []  # the cell's reference still holds it
    del g  # the last reference but the side thread's: not this thread's to destroy
    for _ in range(50):
        if died:
            break
        time.sleep(0.1)
    assert died == ["dpnb-retire-group"]
