"""The calls every torchrun script makes, made safe on a rank that lives across cells.

A script written for torchrun starts with ``init_process_group`` and ends with
``destroy_process_group()``, and may ``sys.exit()``.  On an engine the group
is dpnb's and outlives the cell, so, from the moment the rank has its
identity:

* ``init_process_group(...)`` *adopts* the running group when the backend,
  world size and rank it asks for agree with it (a one-line note says so),
  and raises naming each difference when they do not -- it never tries to
  form a second default group ("initialize the default process group
  twice!");
* ``destroy_process_group()`` of the default group is a noted no-op: the
  group stays up for the next cell, ``new_group``, ``%dp train``, ``reform``
  and ``restart``, and whatever the script built on it (its DDP model, its
  optimizer) stays usable for inspection.  Destroying the group instead
  would have to re-form it, and every object built on it would hold a dead
  group;  groups the user made with ``new_group`` are destroyed as asked;
* ``exit()`` / ``quit()`` end the cell on that rank with ``SystemExit``, like
  ``sys.exit()`` -- IPython's own would shut the engine down after the cell;
* ``%run script.py`` in a cell raises the script's exception, so the cell
  fails like any other (IPython's ``%run`` prints it and reports success).

dpnb's own engine code calls torch's functions through :func:`torch_fn`.
torch is imported inside the functions: :mod:`dpnb.engine.setup` imports this
module, and the notebook side imports that one (to name its functions)
without importing torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..core.errors import UserError

log = logging.getLogger(__name__)

_ORIGINAL = "__dpnb_original__"


def torch_fn(name: str):
    """torch's own ``torch.distributed.<name>``, whatever dpnb put in its place."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    fn = getattr(dist, name)
    return getattr(fn, _ORIGINAL, fn)


class AdoptError(UserError, RuntimeError):
    """``init_process_group`` asked for a group other than the cluster's."""


def _backend_name(b: Any) -> str:
    return str(b).lower() if b is not None else ""


def _differences(state, backend, world_size, rank) -> list[str]:
    out = []
    want = _backend_name(backend)
    if want and want not in ("undefined",):
        # "cpu:gloo,cuda:nccl" asks for both; the cluster's backend must be one of them
        names = {part.split(":")[-1] for part in want.split(",")}
        if state.backend not in names:
            out.append(f"backend {want!r} (the cluster's group is {state.backend})")
    if world_size not in (None, -1) and int(world_size) != state.world_size:
        out.append(f"world_size={world_size} (the cluster has {state.world_size} ranks)")
    if rank not in (None, -1) and int(rank) != state.rank:
        out.append(f"rank={rank} (this engine is rank {state.rank})")
    return out


def _note(text: str) -> None:
    print(f"dpnb: {text}", file=sys.stderr, flush=True)


def _adopting(holder: "_Holder"):
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None,
                           device_id=None, **kwargs):
        """dpnb: the cluster's group is already up on this rank; joining it (see
        :mod:`dpnb.engine.lifecycle`)."""
        # lazy: torch-free at import (boot loads torch in a background thread)
        import torch.distributed as dist

        __tracebackhide__ = True
        st = holder.state
        if not dist.is_initialized():
            raise AdoptError("dpnb's process group is not up on this rank (a re-formation "
                             "failed?): run %dp reform, or %dp restart")
        diff = _differences(st, backend, world_size, rank)
        if diff:
            raise AdoptError("init_process_group asks for another group than the cluster's: "
                             + "; ".join(diff) + ". Drop those arguments (RANK, WORLD_SIZE and "
                             "LOCAL_RANK are set as torchrun sets them), or start a cluster "
                             "that matches (%dp stop, then %dp start -n N --backend B)")
        _note(f"init_process_group() joined the cluster's running {st.backend} group "
              f"({st.world_size} ranks); nothing was re-initialised")

    init_process_group.__dpnb_original__ = holder.originals["init_process_group"]
    return init_process_group


def _keeping(holder: "_Holder"):
    original = holder.originals["destroy_process_group"]

    def destroy_process_group(group=None):
        """dpnb: the default group stays up for the next cells (see
        :mod:`dpnb.engine.lifecycle`); other groups are destroyed."""
        # lazy: torch-free at import (boot loads torch in a background thread)
        import torch.distributed as dist

        if group is None or group is dist.GroupMember.WORLD:
            _note("destroy_process_group() left the cluster's group up for the next cells "
                  "(dpnb owns it; %dp stop ends it)")
            return None
        return original(group)

    destroy_process_group.__dpnb_original__ = original
    return destroy_process_group


class _Holder:
    """What the replacements read: this rank's current state, torch's originals."""

    def __init__(self, state):
        self.state = state
        self.originals = {n: torch_fn(n) for n in ("init_process_group", "destroy_process_group")}


def _rank_exit():
    """``exit`` / ``quit`` on an engine: ``SystemExit`` in the cell, never an engine shutdown."""
    # lazy: boot imports this module before the kernel (and IPython) exists
    from IPython.core.autocall import IPyAutocall

    class RankExit(IPyAutocall):
        rewrite = False

        def __repr__(self) -> str:
            return "dpnb: exit() / quit() end the cell on this rank (the engine keeps running)"

        def __call__(self, code=None):
            raise SystemExit(code)

    return RankExit()


def _raising_execfile(shell):
    """``%run`` raises the script's exception instead of printing it as a success."""
    safe = shell.safe_execfile
    if getattr(safe, _ORIGINAL, None) is not None:
        return safe

    def safe_execfile(fname, *where, exit_ignore=False, raise_exceptions=False, **kw):
        __tracebackhide__ = True  # the report starts at the cell's %run line, then the script
        return safe(fname, *where, exit_ignore=exit_ignore, raise_exceptions=True, **kw)

    safe_execfile.__dpnb_original__ = safe
    return safe_execfile


def install(state) -> None:
    """Put the replacements in place (once per process; later calls re-point them)."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from IPython import get_ipython

    holder = getattr(state, "lifecycle", None)
    if holder is None:
        holder = _Holder(state)
        for mod in (dist, c10d):
            mod.init_process_group = _adopting(holder)
            mod.destroy_process_group = _keeping(holder)
        state.lifecycle = holder
    holder.state = state
    ip = get_ipython()
    if ip is not None:
        exiter = _rank_exit()
        ip.user_ns["exit"] = ip.user_ns["quit"] = exiter
        ip.user_ns_hidden["exit"] = ip.user_ns_hidden["quit"] = exiter
        ip.safe_execfile = _raising_execfile(ip)
