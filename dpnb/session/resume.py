"""``restart --resume``: rebuild what the checkpoint needs, from the cells that built it.

The wrap and the data call name objects on the ranks (the model, the
dataset, a ``--step-fn``).  A replaced engine starts empty, and an FSDP-sharded
model cannot be wrapped again, so before the checkpoint is loaded those
objects must be built again -- by the cells that built them the first time.
:func:`dpnb.core.cellgraph.plan` finds them in the cluster's history (the
cells marked ``%%dp --setup`` and, inferred, the ones that bound the needed
names); this module turns the cluster's state into that question, refuses
before anything is replaced when a name cannot be rebuilt, and replays:

* ddp / zero1: the cells run on the replaced ranks only (survivors keep their
  objects); a cell that calls a collective or builds DDP/FSDP runs everywhere;
* zero2 / zero3: ``fully_shard`` changed every rank's module in place, so the
  model is rebuilt on every rank;

then the wrap and data calls on every rank, then the checkpoint is loaded
(DCP: every rank reads its part).

With no folder, a survivor's replica comes first (:mod:`.replica`: DDP, every
survivor holds the whole state, fresher than any checkpoint); the latest
automatic checkpoint is the fallback, and its refusal says why memory could
not serve.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..cluster.diagnose import first_error
from ..cluster.types import EntryKind
from ..core.cellgraph import HistoryCell, ResumePlan, cell_summary, plan
from ..core.strategies import is_fsdp
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from ..ranks import rank_label
from . import replica, verbs
from .record import DataStep, WrapStep

if TYPE_CHECKING:  # pragma: no cover
    from . import Cluster

#: names every rank has without any cell (dpnb.engine.setup.init_rank, IPython)
PROVIDED = frozenset({"rank", "world_size", "local_rank", "device", "torch", "dist",
                      "get_ipython", "exit", "quit", "In", "Out", "_dpnb"})


def _summary(code: str) -> str:
    return cell_summary(code) or "(empty)"


def needed(c: "Cluster") -> dict[str, str]:
    """name -> what needs it: the wrap's model, the data's dataset, the last
    train's ``--step-fn`` / ``--loss-fn``."""
    out: dict[str, str] = {}
    for e in c.setup_log.calls():
        if isinstance(e, WrapStep):
            out[e.model] = f"the wrap ({e.label})"
        elif isinstance(e, DataStep):
            out[e.dataset] = f"the data ({e.label})"
    last = c.training.last_train
    for key in ("step_fn", "loss_fn"):
        name = getattr(last.args, key) if last else None
        if isinstance(name, str) and name.isidentifier():
            out[name] = f"%dp train --{key.replace('_', '-')} {name}"
    return out


def history_cells(c: "Cluster") -> list[HistoryCell]:
    return [HistoryCell(index=i + 1, code=rec.code, ok=rec.ok, ranks=rec.ranks,
                        setup=c.setup_log.marks(rec))
            for i, rec in enumerate(c.history) if rec.kind == EntryKind.CELL]


def pushed(c: "Cluster") -> set[str]:
    return {n for rec in c.history if rec.kind == EntryKind.PUSH for n in rec.names}


def make_plan(c: "Cluster") -> ResumePlan:
    return plan(history_cells(c), needed(c), PROVIDED)


def refuse_if_incomplete(c: "Cluster", p: ResumePlan) -> None:
    """Before anything is replaced: every needed name must have a cell to rebuild it."""
    if p.ok:
        return
    sent = pushed(c)
    parts = []
    for name, why, advice in p.missing:
        if name in sent:
            advice = f"it came from the notebook (%dp push): build {name} in a %%dp cell instead"
        parts.append(f"{name!r} (needed by {why}): {advice}")
    raise DpnbError("resume cannot rebuild " + "; ".join(parts) + ". Nothing was replaced.")


def describe(c: "Cluster") -> list[str]:
    """What ``restart --resume`` would replay now, for ``%dp setup``."""
    p = make_plan(c)
    lines = [f"cell {r.index}: {_summary(r.code)}  ({r.why}"
             f"{'; runs on every rank: it calls a collective' if r.everywhere else ''})"
             for r in p.cells]
    lines += [f"{e.label}" for e in c.setup_log.calls()]
    lines = [f"{i + 1}. {line}" for i, line in enumerate(lines)]
    lines += [f"left out: {what} -- {why}" for what, why in p.left_out]
    lines += [f"cannot rebuild {name!r} ({why}): {advice}" for name, why, advice in p.missing]
    if p.unbound:
        lines.append(f"read but bound by no cell (the replay may fail): {', '.join(p.unbound)}")
    return lines


def rebuild_ranks(c: "Cluster", replaced: list[int]) -> tuple[list[int], str]:
    """Ranks whose model must be built again, and why."""
    strategy = c.training.strategy
    if is_fsdp(strategy):
        return list(range(c.world_size)), (f"{strategy} shards the module in place, so it "
                                           f"cannot be wrapped again")
    return sorted(replaced), "" if not replaced else "they started empty"


def replay_and_load(c: "Cluster", path: str, p: ResumePlan, replaced: list[int],
                    as_load: bool = False) -> str:
    """Replay ``p`` (cells on the ranks that rebuild, the calls everywhere), then load.

    ``as_load``: the checkpoint is where the state now starts (a resume from
    disk: the steps after it are gone), recorded as a load; a resize's own
    save-and-load (``as_load`` False) changes nothing of the state."""
    ranks, why = rebuild_ranks(c, replaced)
    ran = []
    for r in p.cells:
        sel = None if r.everywhere else ranks
        if sel == []:
            continue
        res = c.run(r.code, ranks=sel, display=False, raise_errors=False, history=False)
        if not res.ok:
            raise DpnbError(f"resume stopped: replaying cell {r.index} ({_summary(r.code)}) "
                            f"failed ({first_error(res)}); fix it and %dp load {path}")
        ran.append(r)
    calls = c.setup_log.calls()
    for e in calls:
        dotted, args, kw = e.call()
        c.call(dotted, *args, **kw)
    info = c.call(ep.LOAD, path).values[0]
    if as_load:
        verbs.loaded(c, path, info)
    cells = "; ".join(f"cell: {_summary(r.code)} ({r.why})" for r in ran) or "none"
    who = (f"Rebuilt on {rank_label(ranks)} ({why}) from {len(ran)} cell"
           f"{'s' if len(ran) != 1 else ''}: {cells}." if ranks else
           "No rank needed rebuilding: every rank kept its objects.")
    left = "".join(f" Left out: {what} ({why2})." for what, why2 in p.left_out)
    return (f"Resumed from {path} at step {info.get('step')}. {who} Then on every rank: "
            f"{'; '.join(e.label for e in calls)}; the checkpoint.{left}")


def latest_autosave(c: "Cluster") -> str:
    """The newest checkpoint ``%dp train --checkpoint-every K DIR`` wrote."""
    d = c.training.autosave_dir
    if not d:
        raise DpnbError("no automatic checkpoint yet: train with --checkpoint-every K DIR, or "
                        "give --resume DIR")
    try:
        with open(os.path.join(d, "latest")) as f:
            path = os.path.join(d, f.read().strip())
    except OSError as e:
        raise DpnbError(f"no checkpoint in {d} yet ({e.strerror}): give --resume DIR") from None
    return path


def _latest_or_why(c: "Cluster", why_not: str) -> str:
    """The latest automatic checkpoint; refused, it says why memory could not serve."""
    try:
        return latest_autosave(c)
    except DpnbError as e:
        raise DpnbError(f"{e} (no replica to rebuild from: {why_not})") from None


def restart_and_resume(c: "Cluster", *, hard: bool, resume: str | bool) -> str:
    """``%dp restart --resume [DIR]``: everything that can refuse is checked before
    any engine is replaced; then the runtime restarts, and the replaced ranks
    (or every rank, under FSDP) rebuild and load the checkpoint."""
    latest, why_not = resume == "" or resume is True, ""
    if not hard:  # a frozen rank cannot finish its call nor answer: it is replaced
        c.end_frozen()
    if latest:  # from a survivor's replica when there is one: fresher than any checkpoint
        src, why_not, steps = replica.source(c, hard)
        if src is not None:
            if not c.setup_log.wrapped:
                raise DpnbError("nothing to resume: no model was wrapped in this cluster's "
                                "history")
            p = make_plan(c)
            refuse_if_incomplete(c, p)  # before any engine is replaced
            return replica.rebuild(c, src, steps, p, hard)
    path = _latest_or_why(c, why_not) if latest else str(resume)
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise DpnbError(f"no checkpoint folder at {path}: give a folder %dp save wrote")
    if not c.setup_log.wrapped:
        raise DpnbError("nothing to resume: no model was wrapped in this cluster's "
                        "history; build and %dp wrap it, then %dp load DIR")
    p = make_plan(c)
    refuse_if_incomplete(c, p)  # before any engine is replaced
    done = c.replace_and_reform(hard=hard)
    disk = f"Not from memory ({why_not}): from the disk checkpoint. " if latest else ""
    return done.message + " " + disk + replay_and_load(c, path, p, list(done.replaced),
                                                       as_load=True)
