"""``%dp incidents``: what happened to a run, each fault with its time to healthy.

On one 2-rank cluster, as a user meets them: a cell that raises in the middle
of a collective (the waiting rank released, the group re-formed at once), a
cell stopped by its timeout, a rank SIGKILLed from outside and replaced by
``%dp restart``.  Each is listed in order with the ranks it hit,
and each healed within the bound of the step that healed it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import dpnb
from dpnb.core.incidents import rows
from dpnb.errors import RemoteCellError
from helpers.shell import magics_on


def test_each_fault_is_listed_with_the_ranks_it_hit_and_its_time_to_healthy(capsys):
    with dpnb.start(2, timeout=10.0) as c:
        t0 = time.time()
        assert c.incidents == ()
        with pytest.raises(RemoteCellError):  # rank 1 raises while rank 0 waits in the all_reduce
            c.run("import time\nif rank == 1:\n    time.sleep(0.3)\n    raise ValueError('boom')\n"
                  "dist.all_reduce(torch.ones(1))", display=False)
        res = c.run("import time\nif rank == 0:\n    time.sleep(3)", timeout=0.5, display=False,
                    raise_errors=False)
        assert not res.ok
        c.wait_settled(10)
        victim = c.ranks[1].pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RemoteCellError):
            c.run("dist.barrier()", display=False)
        c.restart()
        table = rows(c.incidents, c.created)
        kinds = [(r.kind, r.ranks) for r in table]
        assert kinds == [("group broken", ()), ("group broken", ()), ("died", (1,)),
                         ("group broken", ())], kinds
        # the raise mid-collective: the waiting rank released; the timeout: rank 0's
        # call interrupted and the group re-formed; the kill: named, the group with it
        assert "released" in table[0].detail, table[0]
        assert "rank 0: timeout" in table[1].detail and "re-formed at once" in table[1].detail
        assert "SIGKILL" in table[2].detail and "without rank 1" in table[3].detail
        spent = time.time() - t0
        for r in table:  # every fault healed, within the test's own time
            assert r.healthy_after_s is not None and 0 <= r.healthy_after_s <= spent, r
        assert [i.kind for i in c.incidents][-2:] == ["replaced", "healthy"]
        with magics_on(c) as ip:
            capsys.readouterr()
            ip.run_line_magic("dp", "incidents")
            out = capsys.readouterr().out
        assert out.count("(healthy ") == 4 and "died         rank 1: killed" in out, out
        assert "4 faults; healthy again after each" in out, out
        assert "no training steps recorded" in out, out  # no model was wrapped
