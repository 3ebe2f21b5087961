"""Registering an engine-side cell hook once per engine process, on first use.

The profiler's (``--profile``) and JupyterLab's debugger's (``--dap``) hooks
read their flag off each cell (:mod:`dpnb.core.cellflags`); the session
registers one on an engine the first time a cell needs it -- one call to
those ranks, none after -- and remembers engines by PID, so an engine that
replaced a dead rank is armed again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


def arm(cluster, entry: str, ranks: Iterable[int], armed: set[int], what: str,
        without: str) -> None:
    """Call ``entry`` on those of ``ranks`` whose engine is not in ``armed`` (PIDs);
    add the ones that registered.  ``what``: the hook's name in a warning; ``without``:
    what a rank that did not register does instead."""
    todo = [r for r in ranks if cluster.ranks[r].pid not in armed]
    if not todo:
        return
    res = cluster.call(entry, ranks=todo, raise_errors=False)
    for r, o in res.outcomes.items():
        if o.ok and o.value:
            armed.add(cluster.ranks[r].pid)
        else:
            log.warning("%s hook not registered on rank %s: %s: %s (%s)", what, r, o.ename,
                        o.evalue, without)
