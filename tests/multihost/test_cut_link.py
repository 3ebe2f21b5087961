"""A link cut between two hosts for good, end to end: 2 + 2 ranks over ssh, DDP.

While ``%dp train`` runs, the second host's link goes down.  The notebook's
ssh client to that host's agent notices within its keep-alive bound (about
15 s) and ends; the ranks there are named dead with ssh's own words for a
cut ("not responding"), and the call returns -- released, not left to the
group timeout.  A restart while the host is still cut off costs one ssh
connect timeout and says, in one line, that the host does not answer and
what to do; the ranks on the first host keep their state.  Once the link is
back, the restart opens a new agent there and replaces the two ranks; the
engines the old agent left running there end.
"""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

import dpnb
from dpnb.errors import DpnbError
from helpers import hosts as _hosts
from helpers import nbutil as nbu
from helpers import slowtrain

pytestmark = pytest.mark.timeout(300)


def _link(host, state: str) -> None:
    subprocess.run(["ip", "link", "set", host.veth, state], check=True, timeout=10)


def test_a_cut_link_is_named_and_the_host_is_rebuilt_once_it_answers(two_hosts):
    hs = two_hosts
    a, b = hs.hosts
    c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, timeout=60,
                   remote_python=_hosts.remote_python(),
                   launcher_args=[f"{a.name}=2", f"{b.name}=2"])
    try:
        slowtrain.wrapped(c)
        left = {hs.outer_pid(b, c.ranks[r].pid): None for r in (2, 3)}
        left = {p: psutil.Process(p).create_time() for p in left}
        t, out = slowtrain.training(c, steps=5000)
        cut = time.monotonic()
        _link(b, "down")
        try:
            t.join(60)  # under the group timeout (60 s): released, not timed out
            assert not t.is_alive(), "train still waiting 60 s after the cut"
            err = out.get("error")
            assert err is not None, out
            took = out["returned"] - cut
            assert took < 45.0, f"released {took:.1f} s after the cut"
            assert sorted(err.died) == [2, 3], err.died
            for r in (2, 3):
                assert f"the ssh connection to {b.name} ended" in err.died[r], err.died
                assert "not responding" in err.died[r], err.died
            t0 = time.monotonic()
            with pytest.raises(DpnbError) as ei:
                c.restart()
            said = str(ei.value)
            assert said.startswith(f"host {b.name} does not answer") and "\n" not in said, said
            assert "%dp restart again" in said, said
            assert time.monotonic() - t0 < 40.0
        finally:
            _link(b, "up")
        assert [c.pull("mine", rank=r) for r in (0, 1)] == [0, 1]  # nothing lost on a
        msg = c.restart()
        assert "ranks 2-3 replaced" in msg, msg
        # The old agent's engines, still running on b after the cut, end: the new
        # agent ends them (agentrecords; tests/unit/test_agent_revive.py), unless
        # the old agent's own session broke first after the link came back and it
        # stopped them itself (a SIGTERM, then SIGKILL after 3 s) -- here that
        # happens often enough that this test passes without the new agent's part
        # (measured), so it proves only that they end.  In one full-suite run they
        # were still "sleeping" when looked at at once, without this wait.
        assert nbu.alive(left, wait_s=10) == {}
        assert [c.ranks[r].host for r in range(4)] == [a.name, a.name, b.name, b.name]
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), globals().get('mine'))",
                  display=False)
        assert r.ok and c.pull("out") == [(4.0, 0), (4.0, 1), (4.0, None), (4.0, None)]
    finally:
        _link(b, "up")
        c.stop()
