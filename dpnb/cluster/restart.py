"""Bringing the world back: replace dead engines and re-form the group.

A replacement engine takes the dead rank's number (and its local rank and
device) and starts empty; survivors keep their namespaces.  State changes only
once the step that justifies it succeeded: a rank stops counting as dead when
its replacement is probed, busy marks go when the group is re-formed.

``restart --resume`` (rebuild the model on the replaced ranks and load a
checkpoint) is the training session's (:mod:`dpnb.session.resume`): it asks
this module which ranks were replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.timeouts import form_timeout
from ..ranks import rank_label
from . import engines
from .diagnose import kept
from .group import Group, moved_sentences
from .worldref import WorldRef
from .transport import Transport
from .types import Health

if TYPE_CHECKING:  # pragma: no cover
    from .launchers import EngineLauncher

#: ``Engines.adopt_ranks``: takes a new rank table (``fresh=``, ``new_world=``)
Adopt = Callable[..., None]

log = logging.getLogger(__name__)


def end_frozen(t: Transport, h: Health, kill: Callable[[int], None]) -> dict[int, str]:
    """Kill the live ranks whose engine is frozen (stopped, held by a tracer), so that
    the restart replaces them: a frozen rank runs no code, would hold the group's
    re-formation until its timeout, and cannot finish the cell it was in.  The
    user asked for a restart instead of continuing it; each is marked dead with
    how it was found.  Returns ``{rank: how}``."""
    frozen = t.frozen([r for r in range(len(t.ranks)) if r not in h.dead])
    for r, how in sorted(frozen.items()):
        kill(r)
        h.died(r, f"frozen ({how}): killed by the restart to be replaced")
    return frozen


def _settle_busy(t: Transport, h: Health, kill: Callable[[int], None], timeout_s: float,
                 hard: bool) -> None:
    """Interrupt survivors still running an old cell; kill those that do not stop."""
    busy = [r for r in h.busy if r not in h.dead]
    if not busy or hard:
        return
    t.interrupt(busy)
    # an interrupted rank stops at once unless a collective holds it, which
    # the group timeout (30 min by default) ends: wait a formation's time
    deadline = time.monotonic() + form_timeout(timeout_s) + 10
    while time.monotonic() < deadline:
        t.refresh_busy()
        if not [r for r in h.busy if r not in h.dead]:
            return
        time.sleep(0.2)
    for r in sorted(r for r in h.busy if r not in h.dead):
        kill(r)
        h.died(r, "killed by restart: it did not respond to interrupts")


@dataclass(frozen=True)
class Restarted:
    """What a restart did: the ranks given fresh engines, and the sentence saying so."""

    replaced: tuple[int, ...]
    message: str


def restart(t: Transport, group: Group, launcher: EngineLauncher, worlds: WorldRef,
            health: Health, adopt: Adopt, *, hard: bool = False) -> Restarted:
    """See :meth:`dpnb.cluster.Engines.restart`.

    Who does what: the transport finds the dead and interrupts the busy, the
    launcher kills and starts engines, ``adopt`` (``Engines.adopt_ranks``)
    takes the new rank table, the group re-forms over every rank; ``worlds``
    is read afresh after each of them, since each replaces the world.
    """
    def kill(r: int) -> None:
        launcher.kill(worlds.now.ranks[r])

    t.refresh_busy()
    if not hard:
        end_frozen(t, health, kill)
    _settle_busy(t, health, kill, group.timeout_s, hard)
    h, size = health, worlds.now.size
    for r, how in t.find_dead([r for r in range(size) if r not in h.dead]).items():
        h.died(r, how)
    replace = list(range(size)) if hard else sorted(h.dead)
    if hard:
        for r in replace:
            if r not in h.dead:
                kill(r)
    spared: tuple[int, ...] = ()
    if replace:
        table, spared = engines.replace(launcher, worlds.now.ranks, replace)
        adopt(table, fresh=replace)
    info = group.reform_all(new=replace)
    h.group_formed(all_settled=True)  # every rank took part: none is running an old cell
    keep = [r for r in range(size) if r not in replace]
    msg = f"World back to {size} ranks, process group re-formed on port {worlds.now.master_port}."
    if replace:
        by = f" ({rank_label(list(spared))} by a spare engine, the next one starting)" \
            if spared else ""
        msg += f" {rank_label(replace)} replaced{by}: everything defined there was lost."
    if keep:
        msg += f" {kept(keep)}."
    msg += moved_sentences(info)
    return Restarted(tuple(replace), msg)
