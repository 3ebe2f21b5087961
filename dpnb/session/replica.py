"""``restart --resume`` with no folder, from memory: the replaced rank takes a survivor's replica.

Under DDP every surviving rank holds the whole training state, fresher than any
checkpoint on disk.  This module decides whether that path applies -- before
any engine is replaced -- and drives it:

1. ask the survivors what they hold (:func:`dpnb.engine.rebuild.replica_info`);
   the source is the survivor furthest along (lowest rank among equals);
2. replace the dead engines and re-form the group (the runtime's restart);
3. replay, on the replaced ranks only, the setup cells that built the model and
   the dataset (:mod:`.resume` finds them) and the dataset choice;
4. on every rank, :func:`dpnb.engine.rebuild.from_replica`: the source
   broadcasts weights, optimizer state, step and data position over the new
   group; the replaced rank wraps, survivors re-bind;
5. the timing hooks of ``%dp gradsync`` on the replaced ranks.

When it does not apply (a strategy with sharded state, no survivor holding the
model, ``--hard``), :func:`source` says why and :mod:`.resume` falls back to
the latest disk checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cluster.diagnose import first_error
from ..cluster.types import EntryKind
from ..core.cellgraph import ResumePlan, cell_summary
from ..errors import DpnbError
from ..ranks import rank_label

if TYPE_CHECKING:  # pragma: no cover
    from . import Cluster

_T = "dpnb.engine.training."
_R = "dpnb.engine.rebuild."


def _summary(code: str) -> str:
    return cell_summary(code) or "(empty)"


def source(c: "Cluster", hard: bool) -> tuple[int | None, str, dict]:
    """``(src, why_not, steps)``: the survivor to copy from (None: no replica,
    ``why_not`` says why) and each survivor's step."""
    if hard:
        return None, "--hard replaces every engine", {}
    alive = [r for r in range(c.world_size) if r not in c.dead]
    if not alive or not c.dead:
        return None, "no rank died" if alive else "no rank survived", {}
    res = c.call(_R + "replica_info", ranks=alive, raise_errors=False)
    if not res.ok:
        return None, f"the survivors did not answer ({first_error(res)})", {}
    infos = [i for i in res.values if i.get("wrapped")]
    if len(infos) != len(alive):
        return None, "a survivor holds no wrapped model", {}
    if not all(i["replicated"] for i in infos):
        return None, (f"{infos[0]['strategy']} shards the optimizer state: no survivor holds "
                      f"the lost rank's part"), {}
    steps = {i["rank"]: i["step"] for i in infos}
    best = max(steps.values())
    return min(r for r, s in steps.items() if s == best), "", steps


def _last(c: "Cluster", dotted: str):
    found = [e for e in c.setup_log.entries if e.kind == EntryKind.CALL and e.dotted == dotted]
    return found[-1] if found else None


def rebuild(c: "Cluster", src: int, steps: dict, p: ResumePlan, hard: bool) -> str:
    """Steps 2-5 of the module doc; the report's sentences."""
    wrap = _last(c, _T + "wrap")
    done = c.replace_and_reform(hard=hard)
    replaced = list(done.replaced)
    ran = []
    for r in p.cells:
        res = c.run(r.code, ranks=None if r.everywhere else replaced, display=False,
                    raise_errors=False, history=False)
        if not res.ok:
            raise DpnbError(f"resume stopped: replaying cell {r.index} ({_summary(r.code)}) "
                            f"failed ({first_error(res)}); fix it and %dp restart --resume")
        ran.append(r)
    data = _last(c, _T + "set_data")
    if data is not None:
        c.call(data.dotted, *data.args, ranks=replaced, **data.kwargs)
    out = c.call(_R + "from_replica", src, wrap.args, wrap.kwargs).values
    watch = _last(c, "dpnb.engine.views.watch")
    if watch is not None:
        c.call(watch.dotted, ranks=replaced)
    step = out[0]["step"]
    lost = max(steps.values()) - step  # completed steps some survivor had and src not: 0
    cells = "; ".join(f"cell: {_summary(r.code)} ({r.why})" for r in ran) or "none"
    return (f"{done.message} {rank_label(replaced)} replaced; rebuilt from rank {src}'s "
            f"replica at step {step:,} ({lost} steps lost; the step in flight when the rank "
            f"died runs again). Replayed on {rank_label(replaced)}: {cells}; then the wrap and "
            f"the weights, optimizer state, step and data position from rank {src}.")
