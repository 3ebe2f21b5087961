"""``--spares``: engines kept registered beside the ranks replace a dead rank at once.

A rank is SIGKILLed from outside (as the OOM killer does); ``%dp restart``
must give its number to the spare its host's agent forked at the start --
the very process, by PID -- and ask for the next spare, which the following
restart uses in turn.  A spare that died meanwhile costs only the engine a
restart without spares would start.  Nothing of a spare outlives ``stop``.
The time saved is measured side by side in ``benchmarks/storm.py``
(``--spares``), not asserted here.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import dpnb
from dpnb.errors import DpnbError
from helpers import nbutil as nbu


def _pool(c) -> list[int]:
    return [pid for pids in c.engine_launcher.spares.pool.values() for pid in pids]


def _kill(c, r: int) -> None:
    """SIGKILL rank ``r`` from outside; back once its agent has reported the exit
    (as a user's restart follows the error that named the death)."""
    ri = c.ranks[r]
    os.kill(ri.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while c.engine_launcher.exit_of(ri, None) is None and time.monotonic() < deadline:
        time.sleep(0.02)


def _registered(c, pid: int, wait_s: float = 30.0) -> None:
    """Wait until the spare ``pid`` is on the controller's list (an engine no rank holds)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(set(c.client.ids) - c.engine_launcher.spares.seen) >= 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"spare PID {pid} did not register within {wait_s:.0f} s")


@pytest.fixture
def c():
    c = dpnb.start(2, spares=1, timeout=60)
    yield c
    c.stop()


def test_a_dead_rank_is_given_its_hosts_spare_and_the_next_spare_follows(c):
    c.run("kept = 41", ranks=[0], display=False)
    procs = {}
    for round_ in range(2):
        (spare,) = _pool(c)
        procs[spare] = psutil.Process(spare).create_time()
        _registered(c, spare)
        _kill(c, 1)
        msg = c.restart()
        assert "rank 1 replaced (rank 1 by a spare engine" in msg, msg
        assert c.ranks[1].pid == spare, (round_, c.ranks[1], spare)  # the spare itself
        (nxt,) = _pool(c)
        assert nxt != spare
        c.run("import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
              "s = t.item()", display=False)
        assert list(c.pull("s")) == [2.0, 2.0]
    assert c.pull("kept", rank=0) == 41
    assert c.spares.describe().startswith("spare engines: 1 on localhost (a restart gives")
    (last,) = _pool(c)
    procs[last] = psutil.Process(last).create_time()
    c.stop()
    assert not nbu.alive(procs, wait_s=10), "a spare outlived stop"


def test_a_spare_that_died_costs_only_a_cold_start(c):
    (spare,) = _pool(c)
    _registered(c, spare)
    os.kill(spare, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while c.engine_launcher.spares.count().get("localhost") and time.monotonic() < deadline:
        time.sleep(0.05)  # its agent reports the exit
    _kill(c, 0)
    t0 = time.monotonic()
    msg = c.restart()
    took = time.monotonic() - t0
    assert "rank 0 replaced:" in msg and "spare" not in msg, msg
    assert took < 30, f"restart took {took:.1f} s"  # never a wait on the dead spare's engine
    assert len(_pool(c)) == 1 and _pool(c) != [spare]  # the pool is whole again


def test_spares_without_an_agent_are_refused_in_one_line_before_anything_starts():
    with pytest.raises(DpnbError) as e:
        dpnb.start(2, spares=1, zygote=False)
    assert "--spares needs engines that dpnb's host agents fork" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(DpnbError, match="--spares -1: give a count of 0 or more"):
        dpnb.start(2, spares=-1)
