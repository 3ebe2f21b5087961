"""``restart --resume`` with no folder, from memory: the replaced rank takes a survivor's replica.

Under DDP every surviving rank holds the whole training state, fresher than any
checkpoint on disk.  This module decides whether that path applies -- before
any engine is replaced -- and drives it:

1. ask the survivors what they hold (:func:`dpnb.engine.train.rebuild.replica_info`);
   the source is the survivor furthest along (lowest rank among equals);
2. replace the dead engines and re-form the group (the runtime's restart);
3. replay, on the replaced ranks only, the setup cells that built the model and
   the dataset (:mod:`.resume` finds them) and the dataset choice;
4. on every rank, :func:`dpnb.engine.train.rebuild.from_replica`: the source
   broadcasts weights, optimizer state, step and data position over the new
   group; the replaced rank wraps, survivors re-bind;
5. the timing hooks of ``%dp gradsync`` on the replaced ranks.

When it does not apply (a strategy with sharded state, no survivor holding the
model, ``--hard``), :func:`source` says why and :mod:`.resume` falls back to
the latest disk checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..cluster.diagnose import first_error
from ..core.cellgraph import ResumePlan, cell_summary
from ..core.peerplan import every_in_force, holders, memory_line, placement_line
from ..core.strategies import is_fsdp
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from ..ranks import rank_label
from .record import DataStep, WatchStep, WrapStep

if TYPE_CHECKING:  # pragma: no cover
    from . import Cluster

log = logging.getLogger(__name__)


#: how long a restart --resume waits for survivors still finishing a failed call
SETTLE_S = 30.0


def _summary(code: str) -> str:
    return cell_summary(code) or "(empty)"


def source(c: "Cluster", hard: bool) -> tuple[int | dict | None, str, dict]:
    """``(src, why_not, steps)``: the survivor to copy from -- a rank (its
    replica), or under sharded strategies ``{dead: holder of its copy}`` --
    or None (``why_not`` says why); and each survivor's step."""
    if hard:
        return None, "--hard replaces every engine", {}
    c.status()  # finds deaths not yet seen (a second rank killed with the first)
    # a survivor may still be finishing the call its peers' death failed (released, it
    # reports back in seconds; on a loaded host, past the wait's grace): let it
    busy = c.wait_settled(SETTLE_S)
    alive = [r for r in range(c.world_size) if r not in c.dead]
    if not alive or not c.dead:
        return None, "no rank died" if alive else "no rank survived", {}
    if busy:  # asking it would be refused ("still running an earlier cell"): the restart
        # interrupts it and the disk serves (seen once under CI's load, past the 30 s)
        return None, f"{rank_label(busy)} still busy {SETTLE_S:.0f} s after a peer died", {}
    res = c.call(ep.REPLICA_INFO, ranks=alive, raise_errors=False)
    if not res.ok:
        return None, f"the survivors did not answer ({first_error(res)})", {}
    infos = [i for i in res.values if i.get("wrapped")]
    if len(infos) != len(alive):
        return None, "a survivor holds no wrapped model", {}
    steps = {i["rank"]: i["step"] for i in infos}
    if not all(i["replicated"] for i in infos):
        infos = agree_on_a_pair(c, infos)
        holders, why, at = peer_holders(c, infos)
        disk = _disk_step(c)
        if holders is not None and disk is not None and disk > at:
            holders, why = None, (f"the disk checkpoint of step {disk:,} is fresher than the "
                                  f"peer copies of step {at:,}")
        if holders is None:
            return None, (f"{infos[0]['strategy']} shards the optimizer state and {why}"), {}
        return holders, "", steps
    best = max(steps.values())
    return min(r for r, s in steps.items() if s == best), "", steps


def _disk_step(c: "Cluster") -> int | None:
    """The step of the latest automatic checkpoint (``DIR/latest`` names
    ``step-NNNNNNNN``), or None."""
    d = c.training.autosave_dir
    try:
        with open(os.path.join(d, "latest")) as f:
            return int(f.read().strip().split("-")[-1])
    except (TypeError, OSError, ValueError) as e:
        log.debug("no automatic checkpoint to compare with the peer copies: %s", e)
        return None


def agree_on_a_pair(c: "Cluster", infos: list) -> list:
    """A rank killed while the copies' agreement (one ``all_reduce``) completed can leave
    the survivors one copy apart: the ones that committed the new pair still keep the
    old one (``spare_step``), and go back to it; their answers replace the old ones.
    Anything else is left as it is (:func:`peer_holders` says why it cannot serve)."""
    owns = {i["peer"]["own_step"] for i in infos}
    if len(owns) < 2 or None in owns:
        return infos
    oldest = min(owns)
    newer = [i["rank"] for i in infos if i["peer"]["own_step"] != oldest]
    if any(i["peer"].get("spare_step") != oldest for i in infos if i["rank"] in newer):
        return infos
    log.info("survivors one peer copy apart (steps %s): ranks %s go back to step %d",
             sorted(owns), newer, oldest)
    res = c.call(ep.PEER_ROLL_BACK, oldest, ranks=newer, raise_errors=False)
    if not res.ok:  # left apart: peer_holders says so, and the disk serves
        log.warning("going back to the peer copies of step %d failed: %s", oldest, first_error(res))
        return infos
    back = dict(zip(res.ranks, res.values))
    return [dict(i, peer=back[i["rank"]]) if i["rank"] in back else i for i in infos]


def peer_holders(c: "Cluster", infos: list) -> tuple[dict | None, str, int | None]:
    """``({replaced rank: survivor holding its copy}, "", step)``, or None and why not.

    Every survivor must have committed its own snapshot at one step S (a death
    during a copy leaves them all on the previous pair), and each dead rank's
    holder (the next rank, or one on another host: the survivors name them)
    must be alive and hold that rank's copy from S."""
    n = c.world_size
    peer = {i["rank"]: i["peer"] for i in infos}
    placed = next((p["holders"] for p in peer.values() if p.get("holders")), None)
    owns = {p["own_step"] for p in peer.values()}
    if None in owns:
        return None, "no peer copy was made yet (every K steps of %dp train)", None
    if len(owns) != 1:
        return None, f"the survivors' snapshots are from different steps {sorted(owns)}", None
    step = owns.pop()
    holders = {}
    for d in sorted(c.dead):
        h = placed[d] if placed else (d + 1) % n
        if h not in peer:
            return None, (f"rank {d} and rank {h}, which held the only copy of its shard, "
                          f"both died"), None
        if peer[h]["copy_of"] != d or peer[h]["copy_step"] != step:
            return None, f"rank {h} holds no copy of rank {d}'s shard from step {step}", None
        holders[d] = h
    return holders, "", step


def _replay(c: "Cluster", p: ResumePlan, ranks: list[int]) -> str:
    """The setup cells on ``ranks`` (a collective one everywhere), the dataset
    choice on the replaced ones; what ran, for the report."""
    ran = []
    for r in p.cells:
        res = c.run(r.code, ranks=None if r.everywhere else ranks, display=False,
                    raise_errors=False, history=False)
        if not res.ok:
            raise DpnbError(f"resume stopped: replaying cell {r.index} ({_summary(r.code)}) "
                            f"failed ({first_error(res)}); fix it and %dp restart --resume")
        ran.append(r)
    return "; ".join(f"cell: {_summary(r.code)} ({r.why})" for r in ran) or "none"


def rebuild(c: "Cluster", src: int | dict, steps: dict, p: ResumePlan, hard: bool) -> str:
    """Steps 2-5 of the module doc; the report's sentences.  ``src`` a rank:
    its replica; a dict: every rank back to the peer copies' step."""
    _, wrap_args, wrap_opts = c.setup_log.last(WrapStep).call()
    done = c.replace_and_reform(hard=hard)
    replaced = list(done.replaced)
    # fully_shard changed every rank's module in place: every rank rebuilds it (as resume.py)
    fsdp = not isinstance(src, int) and is_fsdp(c.training.strategy)
    ranks = list(range(c.world_size)) if fsdp else replaced
    cells = _replay(c, p, ranks)
    data = c.setup_log.last(DataStep)
    if data is not None:
        dotted, args, kw = data.call()
        c.call(dotted, *args, ranks=replaced, **kw)
    if isinstance(src, int):
        out = c.call(ep.FROM_REPLICA, src, wrap_args, wrap_opts).values
    else:
        out = c.call(ep.FROM_PEERS, {str(d): h for d, h in src.items()}, wrap_args,
                     wrap_opts).values
    if c.setup_log.last(WatchStep) is not None:
        c.call(WatchStep.entry, ranks=[o["rank"] for o in out if o.get("fresh", True)])
    step = out[0]["step"]
    lost = max(steps.values()) - step  # completed steps a survivor had and lost here
    if isinstance(src, int):
        what = (f"rebuilt from rank {src}'s replica at step {step:,} ({lost} steps lost; the "
                f"step in flight when the rank died runs again)")
        how = f"the weights, optimizer state, step and data position from rank {src}"
    else:
        what = "; ".join(f"rebuilt from rank {h}'s copy of rank {d}'s shard" for d, h in
                         sorted(src.items()))
        what += (f" at step {step:,} ({lost} steps lost; others rolled back to it)")
        how = "every rank's shards, optimizer state, step and data position from the peer copies"
    # the runtime says the replaced ranks lost everything: here they got it back
    head = done.message.replace(f" {rank_label(replaced)} replaced: everything defined there "
                                f"was lost.", "")
    return (f"{head} {rank_label(replaced)} replaced; {what}. Replayed on "
            f"{rank_label(ranks)}: {cells}; then the wrap and {how}.")


def peer_copy_line(c: "Cluster") -> str | None:
    """``%dp memory``'s line on the peer copies: the interval in force and each
    rank's CPU bytes (every rank asked; a copy in flight is waited for).
    None without a wrapped model, or when a rank did not answer (logged)."""
    if c.training.last_wrap is None:
        return None
    res = c.call(ep.PEER_INFO, raise_errors=False)
    if not res.ok:
        log.info("no peer-copy line: %s", first_error(res))
        return None
    vals = res.values
    line = memory_line(vals[0]["every"], [v["bytes"] for v in vals], c.training.strategy)
    where = placement_line(vals[0].get("holders"), [ri.host for ri in c.ranks]) \
        if vals[0]["every"] else None
    return line + (f"\n{where}" if where else "")


def planned_placement(c: "Cluster") -> str | None:
    """``%dp status``'s line on the peer copies, from what the notebook knows
    (no rank asked, so status stays cheap): the interval in force for the
    last wrap and train call (the notebook sets it on every rank), and each
    copy's holder as the ranks compute it from their hosts -- :func:`holders`
    depends on how the ranks fall into hosts, not on the hosts' names, so the
    launcher's names give the plan the ranks' own host names give them.
    None without a wrapped model, on one rank, or with the copies off."""
    st = c.training
    if st.last_wrap is None or c.world_size < 2:
        return None
    every = every_in_force(st.peer_copy_every, st.strategy)
    if not every:
        return None
    hosts = [ri.host for ri in c.ranks]
    return f"peer copies every {every} steps; {placement_line(holders(hosts), hosts)}"
