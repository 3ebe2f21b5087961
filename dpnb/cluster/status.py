"""``%dp status``: one row per rank, from what the notebook knows plus what each engine says.

Dead and busy ranks are not asked (a busy engine would answer only after its
cell); the others answer :func:`dpnb.engine.setup.status` (no collective),
each within 10 s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..engine import setup

if TYPE_CHECKING:  # pragma: no cover
    from . import Engines as Cluster

log = logging.getLogger(__name__)


def status_rows(c: "Cluster") -> list[dict]:
    t, h = c.transport, c.health
    t.refresh_busy()
    live = [r for r in range(c.world_size) if r not in h.dead and r not in h.busy]
    newly_dead = t.find_dead(live)
    h.dead.update(newly_dead)
    live = [r for r in live if r not in newly_dead]

    ars = t.apply(setup.status, (), live)
    infos: dict[int, dict] = {}
    for r, ar in ars.items():
        try:
            infos[r] = ar.get(timeout=10)
        except Exception as e:  # one silent rank must not hide the others' rows
            log.warning("rank %s status: %s: %s", r, type(e).__name__, e)
            infos[r] = {"error": f"{type(e).__name__}: {e}"}
    rows = []
    for ri in c.ranks:
        r = ri.rank
        st = infos.get(r, {})
        alive = r not in h.dead
        if not alive:
            state = "dead: " + h.dead[r]
        elif r in h.busy:
            state = "busy"
        else:
            state = "ok" if "rss_bytes" in st else st.get("error", "?")
        rows.append({
            "rank": r, "host": ri.host, "local_rank": ri.local_rank, "pid": ri.pid,
            "engine_id": ri.engine_id, "device": ri.device, "backend": c.backend,
            "alive": alive, "state": state, "group": st.get("group"),
            "rss_bytes": st.get("rss_bytes"), "cuda_allocated": st.get("cuda_allocated"),
        })
    return rows
