"""The start's wait for engines (dpnb.cluster.registration): an engine the
client was never told of (its notification lost) is found by asking the hub."""

import pytest

from dpnb.cluster import registration
from dpnb.errors import StartError


class FakeClient:
    """A client that hears no notification: its ids are what it was told at connect."""

    def __init__(self, ids, hub):
        self.ids, self.hub, self.closed = list(ids), hub, False

    def queue_status(self):
        if not self.hub:
            raise RuntimeError("NoEnginesRegistered: Can't build targets without any engines")
        return {**{e: {"queue": 0} for e in self.hub}, "unassigned": 0}

    def close(self):
        self.closed = True


class FakeCluster:
    def __init__(self, hub):
        self.hub, self.clients = hub, []

    def connect_client_sync(self):
        c = FakeClient(self.hub, self.hub)  # a fresh connect lists every registered engine
        self.clients.append(c)
        return c


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(registration, "ASK_HUB_S", 0.05)


def test_engines_whose_notifications_were_lost_are_found_by_asking_the_hub():
    hub = [0, 1]
    ic, lost = FakeCluster(hub), FakeClient([], hub)
    got = registration.wait_registered(ic, lost, 2, timeout=5)
    assert got is ic.clients[-1] and got.ids == [0, 1]
    assert lost.closed  # the old client's sockets are not left open


def test_a_client_that_hears_everything_is_kept():
    hub = [0, 1]
    c = FakeClient([0, 1], hub)
    assert registration.wait_registered(FakeCluster(hub), c, 2, timeout=5) is c and not c.closed


def test_an_empty_hub_is_asked_without_error_and_the_timeout_says_what_to_change():
    with pytest.raises(StartError) as ei:
        registration.wait_registered(FakeCluster([]), FakeClient([], []), 2, timeout=0.3,
                                     unreachable=": give --controller-ip")
    assert str(ei.value) == "only 0 of 2 engines registered within 0 s: give --controller-ip"


def test_an_engine_that_ended_ends_the_wait_at_once():
    with pytest.raises(StartError, match="0 of 2 engines registered; then:\nengine 7 exited 1"):
        registration.wait_registered(FakeCluster([]), FakeClient([], []), 2, timeout=3,
                                     failures=lambda: ["engine 7 exited 1"])
