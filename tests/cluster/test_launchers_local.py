"""Both local launchers: the zygote (engines forked from one process that
imported torch once; the default without an NVIDIA driver) and the plain one
(one Python per engine; GPU hosts' default, and ``--no-zygote``)."""

import os
import signal

import psutil
import pytest

import dpnb
from helpers.nbutil import alive


def _parents(c):
    return [psutil.Process(r.pid).ppid() for r in c.ranks]


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "plain"])
def test_spine_kill_restart_stop(zygote):
    c = dpnb.start(2, timeout=8, zygote=zygote)
    try:
        parents = _parents(c)
        if zygote:  # both forked by the one agent, which is this kernel's child
            assert parents[0] == parents[1] != os.getpid()
            assert psutil.Process(parents[0]).ppid() == os.getpid()
        else:  # ipyparallel's launcher started each one from here
            assert parents == [os.getpid()] * 2
        c.run("mine = rank", display=False)
        with pytest.raises(dpnb.RemoteCellError) as ei:
            c.run("t = torch.ones(1)\nif rank == 1:\n    raise KeyError('x')\ndist.all_reduce(t)",
                  display=False)
        assert ei.value.waiting == [0]
        os.kill(c.ranks[1].pid, signal.SIGKILL)
        with pytest.raises(dpnb.RemoteCellError) as ei:
            c.run("dist.barrier()", display=False)
        assert "signal 9" in ei.value.died[1], ei.value.died
        assert "rank 1 replaced" in c.restart()
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), globals().get('mine'))",
                  display=False)
        assert r.ok and c.pull("out") == [(2.0, 0), (2.0, None)]
        owned = c.procs.owned(c.ranks)
    finally:
        c.stop()
    assert alive(owned, wait_s=5) == {}
