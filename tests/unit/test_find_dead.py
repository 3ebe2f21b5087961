"""Which ranks are dead: what the launcher saw, and the controller's own list.

A host agent reports an engine's exit over its connection a moment after it
happens; in that moment the controller may already have dropped the engine.
Two ranks SIGKILLed one after the other: ``restart --resume`` asked the
"survivors", the second dead rank among them, and ipyparallel raised
``IndexError: No such engine: 2`` (a full run on two busy cores).
"""

from types import SimpleNamespace

from dpnb.cluster import transport
from dpnb.cluster.launchers.base import EngineLauncher
from dpnb.cluster.transport import Transport


class _Launcher(EngineLauncher):
    """Only ``exit_of``, as told; ``wait_exit`` is the real one asking it."""

    def __init__(self, exit_of):
        self.exit_of = exit_of


def _transport(exits: dict, registered):
    t = object.__new__(Transport)  # only what find_dead reads: no client, no shell
    ranks = [SimpleNamespace(rank=r, engine_id=10 + r) for r in range(3)]
    t.worlds = SimpleNamespace(now=SimpleNamespace(ranks=ranks, doors={}))
    t.oom_base = {}  # no cgroup watched: deaths are said as they were reported
    t.launcher = _Launcher(lambda ri, door: exits.get(ri.rank))

    def ids():
        if isinstance(registered, Exception):
            raise registered
        return registered

    t.client = type("Client", (), {"ids": property(lambda self: ids())})()
    return t


def test_an_engine_the_controller_dropped_is_dead_before_its_exit_is_reported(monkeypatch):
    monkeypatch.setattr(transport, "EXIT_REPORT_S", 0.2)  # its agent never reports in time
    t = _transport({1: "killed by SIGKILL"}, registered=[10])  # rank 2's engine (12) gone too
    assert t.find_dead([0, 1, 2]) == {
        1: "killed by SIGKILL", 2: "its engine left the controller (its exit not yet reported)"}


def test_a_controller_that_cannot_say_takes_nobody_for_dead():
    t = _transport({}, registered=OSError("controller gone"))
    assert t.find_dead([0, 1, 2]) == {}
    assert _transport({}, registered=[10, 11, 12]).find_dead([0, 1, 2]) == {}


def test_a_gone_engine_s_exit_reported_a_moment_later_is_the_cause_given():
    exits = {}
    t = _transport(exits, registered=[10, 11])  # rank 2's engine gone, its exit not yet seen
    calls = []

    def exit_of(ri, door):
        calls.append(ri.rank)
        return "signal 15" if ri.rank == 2 and calls.count(2) > 2 else None

    t.launcher = _Launcher(exit_of)
    assert t.find_dead([0, 1, 2]) == {2: "signal 15"}
