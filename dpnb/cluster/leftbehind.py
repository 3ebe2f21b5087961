"""A rank left behind by a broken group: still busy in a call no peer will finish.

When a call fails, the notebook releases every rank that answers its side
door (:meth:`Transport.release`): each one's process-group connections are
shut, so whatever collective it is blocked in fails at once, and the peers'
with it.  A rank can miss that.  One frozen at the time answers nothing;
continued later, it goes on inside a collective whose peers have moved on.
One that opened a connection after its release (a group formed in the
moment between: the peer copies' own is formed at a rank's first copy point)
waits on it.  Either holds its cell until the group timeout -- torch's 30
minutes by default -- and every cell meanwhile is refused with "still
running an earlier cell" (seen in CI: a rank continued after a freeze still
busy 30 s later; a survivor of a killed ZeRO-1 rank still busy at the next
cell).

So while the group is broken, each live rank still busy and not frozen is
released once more, by itself (once per rank per break: the set is forgotten
when a group stands again): its call fails as its peers' did, and the next
cell finds it idle within a moment.  ``%dp status`` and every cell's rank
check do it; a restart settles busy ranks its own way (interrupts, then kills).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .transport import Transport
    from .types import Health

log = logging.getLogger(__name__)

#: how long a cell's rank check waits for ranks released here to finish their call
SETTLE_S = 3.0


def release_left_behind(t: "Transport", h: "Health") -> list[int]:
    """Release, once per break, the live ranks busy while the group is broken and
    not frozen; the ranks released now."""
    if h.group_ok:
        t.released_again.clear()
        return []
    ranks = [r for r in sorted(h.busy) if r not in h.dead and r not in t.released_again]
    if not ranks:
        return []
    frozen = t.frozen(ranks)  # a frozen rank answers no side door: its continuing is awaited
    ranks = [r for r in ranks if r not in frozen]
    if not ranks:
        return []
    t.released_again.update(ranks)
    log.info("ranks %s still busy after their group broke: released again", ranks)
    t.release(ranks)
    return ranks
