"""Both local launchers: the zygote (engines forked from one process that
imported torch once; the default without an NVIDIA driver) and the plain one
(one Python per engine; GPU hosts' default, and ``--no-zygote``)."""

import os
import signal
import time

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
        if zygote:  # both forked by the one agent, this kernel's descendant (a fork of
            # its template, or its child where no template is: tests/conftest.py)
            assert parents[0] == parents[1] != os.getpid()
            assert os.getpid() in [p.pid for p in psutil.Process(parents[0]).parents()]
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


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "plain"])
def test_a_restart_right_after_a_kill_from_a_terminal_replaces_the_rank(zygote):
    """``kill -9`` on a rank from a terminal, then ``%dp restart`` at once, before any
    cell has met the death: the rank is replaced.  The engine may not have become
    a zombie yet, nor the zygote reported its exit: the PID says it is ending
    (``processes.ended`` for the zygote's engines, ``local_exit`` for plain ones)."""
    c = dpnb.start(2, timeout=8, zygote=zygote)
    try:
        c.run("mine = rank", display=False)
        for _ in range(3):  # three times: the zygote's report races the restart each time
            os.kill(c.ranks[1].pid, signal.SIGKILL)
            msg = c.restart()
            assert "rank 1 replaced" in msg, msg
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nout = (t.item(), globals().get('mine'))",
                  display=False)
        assert r.ok and c.pull("out") == [(2.0, 0), (2.0, None)]
    finally:
        c.stop()


def test_the_template_forks_each_starts_agent_and_outlives_its_clusters():
    """``%load_ext dpnb`` starts a zygote template (zygote.WarmZygote): each
    start forks its agent from it -- no torch import of its own -- that agent
    forks the engines and ends with its cluster, and the template stays for
    the next start until it is closed."""
    from dpnb.cluster.zygote import WarmZygote

    w = WarmZygote()
    template = {w.pid: psutil.Process(w.pid).create_time()}
    assert w.wait_ready(120)
    seen = []
    for _ in range(2):
        os.environ["DPNB_TEST_LATE"] = "set after the template started"
        try:
            c = dpnb.start(2, timeout=8, warm=w)
        finally:
            del os.environ["DPNB_TEST_LATE"]
        try:
            agent = _parents(c)[0]
            assert _parents(c) == [agent] * 2 and psutil.Process(agent).ppid() == w.pid
            seen.append(agent)
            r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nimport os\n"
                      "out = (t.item(), os.environ.get('DPNB_TEST_LATE'))", display=False)
            assert r.ok and c.pull("out") == [(2.0, "set after the template started")] * 2
            owned = {**c.procs.owned(c.ranks), agent: psutil.Process(agent).create_time()}
        finally:
            c.stop()
        assert alive(owned, wait_s=5) == {}
        assert w.usable() and set(alive(template, wait_s=0)) == set(template)
    assert seen[0] != seen[1]
    w.close()
    assert alive(template, wait_s=5) == {}


def test_a_killed_agent_of_the_template_is_named_by_its_ranks_death():
    """The template reports its forks' exits (the kernel cannot wait for a
    grandchild): an agent killed under its cluster is said to have ended, the
    words its ranks' deaths are named with."""
    from dpnb.cluster.zygote import WarmZygote

    w = WarmZygote()
    try:
        c = dpnb.start(2, timeout=8, warm=w)
        try:
            agent = c.engine_launcher.agents.agents["localhost"].proc
            os.kill(agent.pid, signal.SIGKILL)
            assert agent.wait(10) == -signal.SIGKILL
            said = c.engine_launcher.agents.exit_of("localhost", c.ranks[0].pid)
            assert said == "the zygote agent on this host ended", said
        finally:
            c.stop()
    finally:
        w.close()


def test_an_unused_warm_zygote_ends_with_its_kernel():
    """Its stdin is the kernel's socket: the kernel's exit ends it, unasked."""
    import subprocess
    import sys

    code = ("import psutil\nfrom dpnb.cluster.zygote import WarmZygote\n"
            "w = WarmZygote()\nprint(w.pid, psutil.Process(w.pid).create_time(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert alive({int(out[0]): float(out[1])}, wait_s=30) == {}


def test_a_rank_whose_engine_left_before_the_call_is_named_dead_in_one_line():
    """An engine the controller dropped before dpnb heard of its exit (a whole
    host lost: the second rank's exit not yet reported) is named dead by the
    call that would have reached it -- not a KeyError from inside ipyparallel --
    and the restart brings it back."""
    c = dpnb.start(2, timeout=8)
    try:
        c.run("mine = rank", display=False)
        eid = c.ranks[1].engine_id
        os.kill(c.ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while eid in c.client.ids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eid not in c.client.ids
        with pytest.raises(dpnb.DpnbError) as ei:
            c.run("x = 1", ranks=[1], display=False)  # a selection never sent to before
        said = str(ei.value)
        assert said.startswith("rank 1 died (") and "%dp restart" in said, said
        assert 1 in c.dead
        assert "rank 1 replaced" in c.restart()
        assert c.pull("mine", rank=0) == 0
    finally:
        c.stop()
