"""Both local launchers: the zygote (engines forked from one process that
imported torch once; the default without an NVIDIA driver) and the plain one
(one Python per engine; GPU hosts' default, and ``--no-zygote``)."""

import os
import signal

import psutil
import pytest

import dpnb
from helpers.nbutil import alive
from helpers.releases import raise_before_all_reduce


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
        assert raise_before_all_reduce(c)[0].waiting == [0]
        os.kill(c.ranks[1].pid, signal.SIGKILL)
        with pytest.raises(dpnb.RemoteCellError) as ei:
            c.run("dist.barrier()", display=False)
        assert ei.value.died[1].startswith("killed by signal 9 (SIGKILL)"), ei.value.died
        assert "rank 1 replaced" in c.restart()
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), globals().get('mine'))",
                  display=False)
        assert r.ok and c.pull("out") == [(2.0, 0), (2.0, None)]
        owned = c.procs.owned(c.ranks)
    finally:
        c.stop()
    assert alive(owned, wait_s=5) == {}


def test_a_warm_zygote_is_taken_by_the_start_and_stops_with_the_cluster():
    """``%load_ext dpnb`` starts a zygote ahead (agents.WarmZygote): the
    start forks the engines from that very process, and stop ends it."""
    from dpnb.cluster.agents import WarmZygote

    w = WarmZygote()
    agent = {w.pid: psutil.Process(w.pid).create_time()}
    assert w.wait_ready(120)
    os.environ["DPNB_TEST_LATE"] = "set after the zygote started"
    try:
        c = dpnb.start(2, timeout=8, warm=w)
    finally:
        del os.environ["DPNB_TEST_LATE"]
    try:
        assert _parents(c) == [next(iter(agent))] * 2
        assert w.take() is None  # taken once
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nimport os\n"
                  "out = (t.item(), os.environ.get('DPNB_TEST_LATE'))", display=False)
        assert r.ok and c.pull("out") == [(2.0, "set after the zygote started")] * 2
        owned = c.procs.owned(c.ranks)
    finally:
        c.stop()
    assert alive({**owned, **agent}, wait_s=5) == {}


def test_a_warm_zygote_from_another_environment_is_not_used_and_ends(monkeypatch):
    from dpnb.cluster.agents import WarmZygote

    w = WarmZygote()
    agent = {w.pid: psutil.Process(w.pid).create_time()}
    monkeypatch.setenv("TORCH_TEST_CHANGED", "1")  # read when torch loads: a different set-up
    assert w.take() is None
    assert alive(agent, wait_s=5) == {}


def test_an_unused_warm_zygote_ends_with_its_kernel():
    """Its stdin is the kernel's pipe: the kernel's exit ends it, unasked."""
    import subprocess
    import sys

    code = ("import psutil\nfrom dpnb.cluster.agents import WarmZygote\n"
            "w = WarmZygote()\nprint(w.pid, psutil.Process(w.pid).create_time(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert alive({int(out[0]): float(out[1])}, wait_s=30) == {}
