"""Real-cluster fixtures: 2 gloo engines on this machine.

Starting engines costs seconds, so one cluster serves a module; tests that
break it (kill an engine) start their own or restore it before returning.
"""

import pytest
from IPython.core.interactiveshell import InteractiveShell

import dpnb

GROUP_TIMEOUT = 6.0


@pytest.fixture(scope="module")
def cluster():
    c = dpnb.start(2, timeout=GROUP_TIMEOUT)
    yield c
    c.stop()


@pytest.fixture
def healthy(cluster):
    """The module cluster, checked to be whole before and repaired after."""
    assert cluster.running and not cluster.dead
    yield cluster
    if cluster.running and (cluster.dead or cluster.busy or not cluster.group_ok):
        cluster.restart()


@pytest.fixture(scope="module")
def ip():
    """An IPython shell with ``%load_ext dpnb``; its cluster is stopped after the
    module, and forgotten: the shell is shared by every module of the worker."""
    from dpnb.magics import get_magics

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dpnb")
    yield shell
    c = dpnb.get_cluster(shell)
    if c is not None:
        c.stop()
        m = get_magics(shell)
        if m is not None:
            m.cluster = None
