"""Changing how many ranks a running cluster has: stop or add engines, re-form.

``%dp resize -n M`` (see :mod:`dpnb.session.resize` for the training side) ends here
with the engine work: the highest ranks' engines are stopped (shrink) or new
engines are started where the launcher can place them (grow); every engine
left is given its rank again -- ranks stay contiguous per host, like torchrun
-- and one new process group of ``M`` ranks is formed.  Nothing is re-bound
to the new group here: a wrapped model bound to ``N`` ranks cannot be
re-bound to ``M``; the training layer rebuilds it from a checkpoint.
Survivors keep their namespaces.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import DpnbError
from . import engines

if TYPE_CHECKING:  # pragma: no cover
    from . import Engines as Cluster

log = logging.getLogger(__name__)


def check_target(c: Cluster, m) -> None:
    """One-line errors for a target this cluster cannot take; changes nothing."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise DpnbError(f"-n must be a whole number of ranks >= 1 (got {m!r}); to end the job "
                        f"use %dp stop")
    if m == c.world_size:
        raise DpnbError(f"the cluster already has {m} ranks: nothing to resize")
    cap, why = c.engine_launcher.capacity(c)
    if m > cap:
        raise DpnbError(f"-n {m} is more ranks than the {c.launcher} launcher can place here "
                        f"(at most {cap}: {why}); resize to {cap} or fewer")


def resize_world(c: Cluster, m: int) -> dict:
    """Stop or add engines so that ``m`` ranks remain, then form their group.

    Returns ``{"old", "new", "added", "removed"}`` (rank numbers).  Ranks are
    assigned afresh from the engines' hosts (contiguous per host); on one
    host the survivors keep their numbers.
    """
    check_target(c, m)
    n = c.world_size
    removed, added_eids = [], []
    if m < n:
        removed = list(range(m, n))
        for r in removed:  # kill_rank waits until each is gone
            c.kill_rank(r)
        keep = c.ranks[:m]
    else:
        keep = list(c.ranks)
        added_eids = engines.start_registered(c, m - n,
                                              lambda: c.engine_launcher.start_more(c, m - n))
    ranks = engines.replan(c, keep, added_eids, m)
    added = [ri.rank for ri in ranks if ri.engine_id in added_eids]
    c.adopt_ranks(ranks, fresh=added, new_world=True)
    c.group.init_ranks(new=added)
    c.group.regroup(callbacks=False, hint="; try %dp restart --hard")
    log.info("resized from %d to %d ranks (added %s, removed %s)", n, m, added, removed)
    return {"old": n, "new": m, "added": added, "removed": removed}
