"""What a ``%%dp`` cell's collectives go through: counted for ``%dp where``, and checked.

Every ``torch.distributed`` collective function on the engine is wrapped once,
when the engine gets its rank.  Outside cells (``%dp train``, dpnb's views,
anything run through ``Cluster.call``) the wrapper only passes the call on.
While a cell runs it also

* counts the call (op and its number in the cell) and notes it as the
  rank's current collective, which the side door reports to ``%dp where``
  and to the notebook's deadlock rule -- with the group's ranks or the
  point-to-point peer, so "no rank can ever complete this" can be decided;
* checks it (:mod:`dpnb.engine.cell.collcheck`) before it runs, when it is a
  collective on the default group called from the engine's main thread --
  by the cell's own code, or synchronously by a library the cell called
  (``accelerator.gather`` of an uneven batch would otherwise abort gloo).
  Asynchronous calls made inside libraries (FSDP's all-gathers, ZeRO's
  broadcasts) are not checked: their order is the library's, the same on
  every rank, and a check would stop them overlapping.  Calls on other
  groups, from other threads (autograd's, a DDP comm hook's) and calls made
  inside a collective (``all_gather_object``'s own ``all_gather``) are not
  checked either: a check there could not be made safe.

The default process group is never swapped: whatever a cell builds -- DDP,
FSDP2, ``ZeroRedundancyOptimizer``, Accelerate's ``prepare`` -- binds to the
real group.  ``%%dp --unchecked`` turns the checks off for one cell (hot
hand-written loops); counting stays.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function
from IPython import get_ipython

from dpnb.core.traces import CHECK_MARKER
from dpnb.engine.cell import checkstar, collcheck, p2pcheck
from dpnb.engine import device
from dpnb.engine.debugging import frames, rankpdb


class Guard:
    """The engine's collective wrappers' shared state (one per process).

    ``state`` is the rank's :class:`~dpnb.engine.state.EngineState` (replaced
    when the rank is re-initialised); ``star`` the check connections of the
    group's current formation.
    """

    def __init__(self, state):
        self.state = state
        self.star: checkstar.Star | None = None
        self.active = False  # a %%dp cell is running
        self.checking = True  # ... and its collectives are checked
        self.depth = 0  # inside a wrapped collective (nested calls pass through)
        self.main = threading.main_thread().ident
        self.p2p = False  # the group is gloo: point-to-point calls are checked
        self.poster = p2pcheck.Poster()  # irecv's data receives, posted in call order
        self.nccl = False  # the group is NCCL: each collective passed is marked on the stream

    # -- cell hooks ----------------------------------------------------------
    def pre(self, info=None, *_rest) -> None:
        st = self.state
        st.cell_calls = {}
        st.current_collective = None
        st.debug_detached = False  # breakpoints stop again (dpnb.engine.debugging.rankpdb)
        self.active = True
        self.checking = not collcheck.is_unchecked(info)  # %%dp --unchecked: this cell only
        self.depth = 0
        if self.star is not None:
            self.star.reset_cell()  # every rank starts the cell's history afresh

    def post(self, *_result) -> None:
        self.active = False
        self.state.current_collective = None
        star = self.star
        if star is not None and (star.paired or star.moved):
            # calls paired across lines: a note after the cell, on every rank
            # (the same text where the hub sent the table, so shown once);
            # the notebook takes these lines out of the stream (NOTE_PREFIX)
            for line in collcheck.pairing_notes(star.paired, star.moved):
                sys.stderr.write(collcheck.NOTE_PREFIX + line + "\n")
            sys.stderr.flush()
        rankpdb.settle(self.state)

    def mark(self) -> None:
        """Under NCCL a collective returns once its kernel is queued: note an
        event after it, so the side door can tell a rank whose device wait
        includes an unfinished collective (a peer may never join it) from one
        waiting behind its own compute.  An ``async_op`` call is queued on
        NCCL's stream, which the current one waits for only at ``wait()``:
        its mark may pass first (the rank then reads as running, and its
        wait is bounded by the group timeout, not called a deadlock).
        Collectives torch issues in C++ (DDP's gradient all-reduce) are not
        seen here, for the same reason."""
        self.state.collective_mark = device.mark_collective(self.state.device)

    # -- deciding ------------------------------------------------------------
    def should_check(self, group: Any, async_op: bool, caller) -> bool:
        if not self.checking or self.star is None:
            return False
        if group is not None and group is not dist.GroupMember.WORLD:
            return False
        return not (async_op and frames.is_library(caller.f_code.co_filename))

    def should_check_p2p(self, group: Any, tensor: Any) -> bool:
        """Point-to-point calls: both ends must decide alike, so who called
        (the cell or a library) does not count; gloo and CPU tensors only."""
        return (self.checking and self.star is not None and self.p2p
                and (group is None or group is dist.GroupMember.WORLD)
                and getattr(getattr(tensor, "device", None), "type", "") == "cpu")


def _bind(params: list[str], args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(params, args))
    bound.update(kwargs)
    return bound


def user_site(frame) -> tuple | None:
    """``(file, line)`` of the user's innermost frame, as every rank names it
    (:func:`collcheck.site_key`); no text is built here (it runs per call)."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not frames.is_library(name):
            return collcheck.site_key(name), f.f_lineno
        f = f.f_back
    return None


def _p2p(g: Guard, name: str, bound: dict, caller, call: dict):
    """A checked send / recv / isend / irecv (:mod:`dpnb.engine.cell.p2pcheck`);
    ``call``: this call's note, back in place while its work is waited on."""
    pg = dist.group.WORLD
    t, tag, site = bound["tensor"], int(bound.get("tag") or 0), user_site(caller)
    me = g.state.rank
    if name in ("send", "isend"):
        dst = bound.get("dst", bound.get("group_dst"))
        return p2pcheck.send(pg, t, dst, tag, site, wait=name == "send", note=(g.state, call))
    src = bound.get("src", bound.get("group_src"))
    if name == "recv":
        return p2pcheck.recv(pg, me, t, src, tag, site)
    return p2pcheck.irecv(pg, me, t, src, tag, site, g.poster, note=(g.state, call))


def user_line(frame) -> str:
    """``cell line 3`` / ``train.py line 42`` for the user's innermost frame on a stack."""
    hit = frames.user_frame(frame)
    return hit[2] if hit else ""


def _wrapped(guard: Guard, name: str, fn):
    params = list(inspect.signature(fn).parameters)
    checkable = name in collcheck.SPECS
    p2p = name in collcheck.POINT_TO_POINT

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        __tracebackhide__ = True  # IPython shows the user's line, not this frame
        g = guard
        if not g.active or g.depth or threading.get_ident() != g.main:
            out = fn(*args, **kwargs)
            if g.nccl:
                g.mark()
            return out
        st = g.state
        calls = st.cell_calls
        calls[name] = seq = calls.get(name, 0) + 1
        bound = _bind(params, args, kwargs)
        cur = {"op": name, "seq": seq, "group": bound.get("group"),
               "peer": bound.get("src", bound.get("dst")), "tensor": bound}
        st.current_collective = cur
        g.depth += 1
        try:
            caller = sys._getframe(1)
            if p2p and g.should_check_p2p(bound.get("group"), bound.get("tensor")):
                return _p2p(g, name, bound, caller, cur)
            if checkable and g.should_check(bound.get("group"), bool(bound.get("async_op")),
                                            caller):
                text = collcheck.describe(name, bound)
                cur["index"] = g.star.seq + 1
                cur["phase"] = "check"
                cur["awaiting"] = g.star.awaiting
                if _profiler_enabled():  # the rank's entry, for the profile's lateness
                    with record_function(f"{CHECK_MARKER} {name}"):
                        g.star.call(name, text, collcheck.digest(text), user_site(caller))
                else:
                    g.star.call(name, text, collcheck.digest(text), user_site(caller))
                cur["phase"] = "run"
            out = fn(*args, **kwargs)
            if g.nccl:
                g.mark()
            return out
        except Exception as e:
            # Raised again from here, without torch's frames: IPython formats
            # each frame with its source, and distributed_c10d.py is 5,000
            # lines -- with 8 released engines on 2 cores that formatting was
            # most of a 3 s report.  The message says all that matters.
            e.__traceback__ = None
            raise e from None
        finally:
            g.depth -= 1
            st.current_collective = None

    collective.__dpnb_original__ = fn  # type: ignore[attr-defined]
    return collective


def _patch(guard: Guard) -> None:
    # one wrapper per function, set on both modules: torch compares ops by
    # identity (``P2POp(dist.isend, ...)`` against c10d's ``isend``)
    for name in collcheck.COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or hasattr(fn, "__dpnb_original__"):
            continue
        w = _wrapped(guard, name, fn)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is fn:
                setattr(mod, name, w)


def install(state) -> Guard:
    """Wrap the collectives and register the cell hooks (once per process);
    later calls point the guard at ``state``."""

    guard = getattr(state, "cell_guard", None)
    if guard is None:
        guard = Guard(state)
        _patch(guard)
        ip = get_ipython()
        if ip is not None:
            ip.events.register("pre_run_cell", guard.pre)
            ip.events.register("post_run_cell", guard.post)
        state.cell_guard = guard
    guard.state = state
    return guard


def form_star(state, store) -> None:
    """The check connections of a new formation of the group (every rank at once)."""
    guard = state.cell_guard
    door = state.side_door
    if guard is None or door is None:
        return
    if guard.star is not None:
        guard.star.close()
        guard.star = None
    # the store is new for every formation (a fresh port); its port, the same on
    # every rank (a replaced rank's generation count is not), names the formation
    guard.p2p = dist.get_backend() == "gloo"
    guard.nccl = getattr(state, "backend", None) == "nccl"
    guard.star = checkstar.Star.form(store, state.rank, state.world_size, state.master_addr,
                                     door.token, state.master_port, state.timeout_s)
