"""A rank frozen on another host, end to end: 2 + 2 ranks over ssh, DDP.

Rank 3's engine, on the second host, is stopped with SIGSTOP mid-``%dp
train``.  The notebook cannot see that host's processes; the host's agent
reads the state there when a wait asks (about once a second).  The call
returns within the frozen-rank bound, naming rank 3 as frozen on its host
with how to continue it there -- not dead, not "still running", not after
the group timeout -- and ``restart --resume``, the user's word to replace
it, kills and replaces it from a survivor's replica with no step lost.  The
replacement, like every engine of an ssh host without an NVIDIA driver, is
forked from its host's agent (torch imported once there), not a fresh
Python.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import dpnb
from helpers import hosts as _hosts
from helpers import slowtrain

pytestmark = pytest.mark.timeout(300)


def _forked_from_the_agent(pid: int) -> bool:
    """A forked engine keeps the agent's command line; a fresh one runs engine.boot."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"dpnb.engine.hostagent" in f.read()


def test_a_rank_frozen_on_another_host_is_named_released_and_replaced(two_hosts):
    hs = two_hosts
    a, b = hs.hosts
    c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, timeout=30,
                   remote_python=_hosts.remote_python(),
                   launcher_args=[f"{a.name}=2", f"{b.name}=2"])
    try:
        assert [c.ranks[r].host for r in range(4)] == [a.name, a.name, b.name, b.name]
        for r in range(4):
            host = a if r < 2 else b
            assert _forked_from_the_agent(hs.outer_pid(host, c.ranks[r].pid)), r
        slowtrain.wrapped(c)
        t, out = slowtrain.training(c, steps=2000)
        frozen_pid, inner = hs.outer_pid(b, c.ranks[3].pid), c.ranks[3].pid
        frozen_at = time.monotonic()
        os.kill(frozen_pid, signal.SIGSTOP)
        try:
            t.join(25)  # under the group timeout (30 s): released, not timed out
            assert not t.is_alive(), "train still waiting 25 s after rank 3 was frozen"
            err = out.get("error")
            assert err is not None, out
            took = out["returned"] - frozen_at
            text = str(err) + "\n" + getattr(err, "report", "")
            assert "rank 3 is frozen" in text and "stopped" in text, text
            assert f"kill -CONT {inner} on {b.name}" in text, text
            assert took < 15.0, f"released after {took:.1f} s"
            assert not c.dead and 3 in c.busy
            t0 = time.monotonic()
            msg = c.restart(resume=True)
            took = time.monotonic() - t0
        finally:
            try:
                os.kill(frozen_pid, signal.SIGCONT)  # never leave a process stopped
            except ProcessLookupError:
                pass  # the restart killed it, as it should
        assert "rank 3 replaced" in msg and "0 steps lost" in msg, msg
        # not a wait for the frozen rank to settle (30 s) or to time out: replaced at once
        assert took < 20.0, f"restart --resume took {took:.1f} s"
        assert c.ranks[3].host == b.name
        assert _forked_from_the_agent(hs.outer_pid(b, c.ranks[3].pid))
        again = c.train(steps=3, micro_batch=8, progress=False)
        assert again.steps == 3 and c.check()["ok"]
    finally:
        c.stop()
