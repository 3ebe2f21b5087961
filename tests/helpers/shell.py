"""The IPython shell the cluster tests share, pointed at a cluster for one test."""

from __future__ import annotations

import contextlib

from IPython.core.interactiveshell import InteractiveShell


@contextlib.contextmanager
def magics_on(cluster):
    """The shared shell with ``%load_ext dpnb`` (loaded once) driving ``cluster``;
    the shell's own cluster is put back afterwards."""
    from dpnb.magics import get_magics

    ip = InteractiveShell.instance()
    if get_magics(ip) is None:
        ip.run_line_magic("load_ext", "dpnb")
    m = get_magics(ip)
    old, m.cluster = m.cluster, cluster
    try:
        yield ip
    finally:
        m.cluster = old
