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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import DpnbError
from . import engines

if TYPE_CHECKING:  # pragma: no cover
    from . import Engines as Cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A world size this cluster can take, as :func:`check_target` found it.

    Only ``check_target`` makes one, so :func:`resize_world` checks nothing
    twice: the training layer checks first (before it writes a checkpoint)
    and hands the checked target down.
    """

    old: int
    new: int


@dataclass(frozen=True)
class WorldChange:
    """What :func:`resize_world` did: rank numbers before and after."""

    old: int
    new: int
    added: list[int]
    removed: list[int]


def check_target(c: Cluster, m) -> Target:
    """One-line errors for a target this cluster cannot take; changes nothing."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise DpnbError(f"-n must be a whole number of ranks >= 1 (got {m!r}); to end the job "
                        f"use %dp stop")
    if m == c.world_size:
        raise DpnbError(f"the cluster already has {m} ranks: nothing to resize")
    cap, why = c.engine_launcher.capacity(c.ranks, c.backend, c.gpus)
    if m > cap:
        raise DpnbError(f"-n {m} is more ranks than the {c.launcher} launcher can place here "
                        f"(at most {cap}: {why}); resize to {cap} or fewer")
    return Target(old=c.world_size, new=m)


def resize_world(c: Cluster, target: Target) -> WorldChange:
    """Stop or add engines so that ``target.new`` ranks remain, then form their group.

    Ranks are assigned afresh from the engines' hosts (contiguous per host);
    on one host the survivors keep their numbers.
    """
    if target.old != c.world_size:  # the world changed since the check
        raise DpnbError(f"the cluster has {c.world_size} ranks, not the {target.old} that "
                        f"resize checked: run %dp resize again")
    n, m = c.world_size, target.new
    removed, added_eids = [], []
    if m < n:
        removed = list(range(m, n))
        for r in removed:  # kill_rank waits until each is gone
            c.kill_rank(r)
        keep = c.ranks[:m]
    else:
        keep = c.ranks
        added_eids = engines.start_registered(c.engine_launcher, keep, m - n,
                                              lambda: c.engine_launcher.start_more(keep, m - n))
    ranks = engines.replan(c.engine_launcher, c.backend, c.gpus, keep, added_eids, m)
    added = [ri.rank for ri in ranks if ri.engine_id in added_eids]
    c.adopt_ranks(ranks, fresh=added, new_world=True)
    c.group.init_ranks(new=added)
    c.group.regroup(callbacks=False, hint="; try %dp restart --hard")
    log.info("resized from %d to %d ranks (added %s, removed %s)", n, m, added, removed)
    return WorldChange(old=n, new=m, added=added, removed=removed)
