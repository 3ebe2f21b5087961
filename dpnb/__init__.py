"""dpnb: data-parallel PyTorch training you drive, see and learn from a notebook.

``%load_ext dpnb`` registers the ``%dp`` / ``%%dp`` magics; ``dpnb.start(n=2)``
does the same from plain Python and returns a :class:`dpnb.Cluster`.

This module stays light (no torch, no ipyparallel at import) so that
``import dpnb.core`` and the magics' help are instant.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

try:
    # one version, written once in pyproject.toml; the labextension's
    # package.json is checked against it (tests/unit/test_packaging.py)
    __version__ = version("dpnb")
except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
    __version__ = "0+unknown"

from .cluster import CellResult, RankInfo  # noqa: E402
from .session import Cluster  # noqa: E402
from .errors import DpnbError, RemoteCellError  # noqa: E402

__all__ = ["start", "attach", "Cluster", "CellResult", "RankInfo", "DpnbError", "RemoteCellError",
           "load_ipython_extension", "unload_ipython_extension", "get_cluster"]


def start(n: int = 2, **kwargs) -> Cluster:
    """Start ``n`` engines joined in one process group (``%dp start``); see
    :meth:`Cluster.start`.  This process holds the cluster and opens its door to
    agents (``dpnb mcp``: reads, and what :meth:`Cluster.allow_agent` allows)."""
    return _with_door(Cluster.start(n, **kwargs))


def attach(cluster_id: str | None = None) -> Cluster:
    """Take up a cluster a kernel left running with ``start(..., keep="2h")``
    (``%dp attach``); see :mod:`dpnb.cluster.keep`."""
    return _with_door(Cluster.attach(cluster_id))


def _with_door(c: Cluster) -> Cluster:
    # lazy: the agent's door loads with the first cluster, not with `import dpnb`
    from .agent.door import open_door

    open_door(c)
    return c


def load_ipython_extension(ip) -> None:
    """``%load_ext dpnb``: register ``%dp`` / ``%%dp`` for this IPython session."""
    # lazy: IPython loads with %load_ext dpnb, not with `import dpnb`
    from .magics import get_magics, load

    if get_magics(ip) is None:
        load(ip)


def unload_ipython_extension(ip) -> None:
    # lazy: IPython loads with %load_ext dpnb, not with `import dpnb`
    from .magics import get_magics

    m = get_magics(ip)
    if m is not None:
        m.drop_warm()
        if m.cluster is not None:
            m.cluster.stop()


def get_cluster(ip=None) -> Cluster | None:
    """The cluster started with ``%dp start`` in this IPython session, if any."""
    # lazy: IPython loads with %load_ext dpnb, not with `import dpnb`
    from .magics import get_magics

    m = get_magics(ip)
    return None if m is None else m.cluster
