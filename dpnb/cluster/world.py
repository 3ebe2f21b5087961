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
from .group import Group
from .worldref import World, WorldRef

if TYPE_CHECKING:  # pragma: no cover
    from .launchers import EngineLauncher
    from .restart import Adopt

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


def check_target(world: World, launcher: EngineLauncher, backend: str, gpus, m) -> Target:
    """One-line errors for a target this world cannot take (``launcher``: where
    more engines could go, for ``backend`` on ``gpus``); changes nothing."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise DpnbError(f"-n must be a whole number of ranks >= 1 (got {m!r}); to end the job "
                        f"use %dp stop")
    if m == world.size:
        raise DpnbError(f"the cluster already has {m} ranks: nothing to resize")
    cap, why = launcher.capacity(world.ranks, backend, gpus)
    if m > cap:
        raise DpnbError(f"-n {m} is more ranks than the {launcher.name} launcher can place here "
                        f"(at most {cap}: {why}); resize to {cap} or fewer")
    return Target(old=world.size, new=m)


def resize_world(target: Target, *, worlds: WorldRef, launcher: EngineLauncher, group: Group,
                 gpus, adopt: Adopt) -> WorldChange:
    """Stop or add engines so that ``target.new`` ranks remain, then form their group.

    The launcher stops the highest ranks' engines or starts new ones, ``adopt``
    (``Engines.adopt_ranks``) takes the new table, the group forms over it.
    Ranks are assigned afresh from the engines' hosts (contiguous per host);
    on one host the survivors keep their numbers.
    """
    n, m = worlds.now.size, target.new
    if target.old != n:  # the world changed since the check
        raise DpnbError(f"the cluster has {n} ranks, not the {target.old} that "
                        f"resize checked: run %dp resize again")
    removed, added_eids = [], []
    if m < n:
        removed = list(range(m, n))
        for r in removed:  # kill waits until each is gone
            launcher.kill(worlds.now.ranks[r])
        keep = worlds.now.ranks[:m]
    else:
        keep = worlds.now.ranks
        added_eids = engines.start_registered(launcher, keep, m - n,
                                              lambda: launcher.start_more(keep, m - n))
    ranks = engines.replan(launcher, group.backend, gpus, keep, added_eids, m)
    added = [ri.rank for ri in ranks if ri.engine_id in added_eids]
    adopt(ranks, fresh=added, new_world=True)
    group.init_ranks(new=added)
    group.regroup(callbacks=False, hint="; try %dp restart --hard")
    log.info("resized from %d to %d ranks (added %s, removed %s)", n, m, added, removed)
    return WorldChange(old=n, new=m, added=added, removed=removed)
