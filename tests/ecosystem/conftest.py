"""The ecosystem tier: other people's kind of code on real 2-rank gloo clusters.

Scripts in ``scripts/`` are written the way torchrun scripts are written
(argparse, ``init_process_group`` from the environment, a main guard,
``destroy_process_group`` at the end); cells build DDP, FSDP2, ZeRO and
Accelerate objects themselves.  Every test that uses the module's cluster
``c`` ends with it whole, checked by :func:`ends_whole` after the test: the
same engine PIDs, no rank dead, a next cell's all_reduce over every rank.
Tests that also re-form and restart call :func:`helpers.ecosystem.assert_whole`
themselves (``new_group``, ``reform``, ``restart`` without ``--hard``,
everything defined kept); that costs seconds, so it is not run after each test.
"""

from __future__ import annotations

import pytest

import dpnb


@pytest.fixture(scope="module")
def c():
    cl = dpnb.start(2)  # the default group timeout (torch's 30 min): every "at once" below is far from it
    yield cl
    cl.stop()


@pytest.fixture(autouse=True)
def ends_whole(request):
    """After each test that uses ``c``: the cluster is whole (one cell, ~0.1 s).
    Clusters a test starts itself are its own to check."""
    if "c" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("c")
    pids = [r.pid for r in c.ranks]
    yield
    assert [r.pid for r in c.ranks] == pids and not c.dead, (pids, c.dead)
    r = c.run("_t = torch.ones(1)\ndist.all_reduce(_t)\n_whole = _t.item()", display=False)
    assert r.ok and c.pull("_whole") == [float(c.world_size)] * c.world_size
