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
from dpnb.engine import sidedoor, step
from dpnb.engine.train_state import TrainError


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
