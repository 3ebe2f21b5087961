"""A start whose client hears no engine registration at all still starts.

ipyparallel's client learns of engines registered after it connected only
from PUB/SUB notifications, and a subscriber that has not joined yet misses
them (a CI start waited 120 s with both engines up).  Here every
registration notification the test process's clients receive is dropped:
the start must find its engines by asking the hub, within seconds."""

import time

import pytest
from ipyparallel.client.client import Client

import dpnb


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "plain"])
def test_the_start_finds_engines_whose_notifications_never_came(zygote, monkeypatch):
    dropped = []
    monkeypatch.setattr(Client, "_register_engine", lambda self, msg: dropped.append(msg))
    t0 = time.monotonic()
    c = dpnb.start(2, timeout=40, zygote=zygote)
    try:
        took = time.monotonic() - t0
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = t.item()", display=False)
        assert r.ok and c.pull("out") == [2.0, 2.0]
    finally:
        c.stop()
    assert took < 35, took  # found by asking, not by waiting out the 40 s
