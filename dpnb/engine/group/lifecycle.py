"""The calls every torchrun script makes, made safe on a rank that lives across cells.

A script written for torchrun starts with ``init_process_group`` and ends with
``destroy_process_group()``, and may ``sys.exit()``.  On an engine the group
is dpnb's and outlives the cell, so, from the moment the rank has its
identity:

* ``init_process_group(...)`` *adopts* the running group (a one-line note
  says so) -- it never tries to form a second default group ("initialize the
  default process group twice!") -- and is as strict as torch's: what torch
  2.13 refuses in a fresh torchrun process it refuses here, with torch's
  exception type and message and a clause saying torchrun does the same, so
  a script that works in the notebook works under torchrun.  Parameter by
  parameter (no communication: every rank decides alone, alike):

  - ``backend``, ``world_size``, ``rank``: checked equal to the cluster's
    (``"cpu:gloo,cuda:nccl"`` agrees when one of its names is the group's);
    a difference is an :class:`AdoptError` naming each.  An NCCL cluster's
    group is formed as ``"cpu:gloo,cuda:nccl"``
    (:data:`dpnb.engine.group.netplan.NCCL_GROUP`), so a script naming that string
    gets its CPU collectives, as under torchrun (``backend=None`` in torch
    2.13 forms the accelerator's backend only; naming ``"nccl"`` there
    leaves CPU tensors without a backend -- here they go through gloo);
  - ``init_method``: torch's checks (a string; no ``rank`` / ``world_size``
    both in the URL and as arguments; a scheme torch has a rendezvous for,
    else torch's ``RuntimeError``); a URL's ``?rank=&world_size=`` are
    checked equal; its address is not contacted -- the ranks already met
    through dpnb's store;
  - ``store``: torch's checks (not with ``init_method``; ``world_size`` and
    ``rank`` given), then as above; the store stays the script's own;
  - ``timeout``: not a ``timedelta`` is torch's ``TypeError``; else honoured
    for the rest of the cell, or of the ``%dp run``: gloo's (NCCL's) wait on
    the default group and the collective check's wait for a peer take it,
    and the cluster's group timeout (``%dp start --timeout``) is back when
    the cell ends;
  - ``device_id``: torch's ``ValueError``s (an int without an accelerator, a
    device of another kind, no index, out of range, and ``cpu``: "must be an
    accelerator with an index"); an accelerator must be the device the
    group is bound to (NCCL clusters bind each rank's; a formed group cannot
    be re-bound), else refused;
  - ``pg_options``: refused -- a formed group's backend options cannot
    change;
  - ``group_name`` (torch ignores it) and ``_ranks`` (torch-private): ignored,
    as torch does;
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
import numbers
import sys
from typing import Any

from dpnb import compat
from dpnb.core.errors import UserError

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


#: the clause every refusal torch itself would make ends with
AS_TORCHRUN = " -- torch raises this under torchrun too"


def _rendezvous_check(init_method, rank, world_size) -> tuple[int, int]:
    """What torch's rendezvous refuses before it connects (``env://`` unless
    given); the rank and world size a URL's query names, for the comparison."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    from urllib.parse import urlparse

    url = "env://" if init_method is None else init_method
    if not isinstance(url, (str, bytes)):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}" + AS_TORCHRUN)
    for name, v in (("rank", rank), ("world_size", world_size)):
        if not isinstance(v, numbers.Integral):
            raise RuntimeError(f"`{name}` must be an integer. {v}" + AS_TORCHRUN)
    url = url.decode() if isinstance(url, bytes) else url
    parsed = urlparse(url)
    query = dict(p.split("=", 1) for p in parsed.query.split("&") if "=" in p)
    if (rank != -1 or world_size != -1) and ("rank" in query or "world_size" in query):
        raise AssertionError(f"The url: {url} has node-specific arguments(rank, world_size) "
                             "already." + AS_TORCHRUN)
    if parsed.scheme not in compat.rendezvous_schemes():
        raise RuntimeError(f"No rendezvous handler for {parsed.scheme}://" + AS_TORCHRUN)
    return int(query.get("rank", rank)), int(query.get("world_size", world_size))


def _as_torch(init_method, timeout, world_size, rank, store, device_id):
    """Raise what torch 2.13's ``init_process_group`` raises for these arguments in
    a fresh process (same type, same message, in its order), so a script fails
    here as it would under torchrun.  Returns ``(device_id, rank, world_size)``
    as torch resolves them."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    from datetime import timedelta

    import torch  # lazy: torch-free at import (boot loads torch in a background thread)

    if store is not None and init_method is not None:
        raise AssertionError("Cannot specify both init_method and store." + AS_TORCHRUN)
    if store is not None:
        if not world_size > 0:
            raise AssertionError("world_size must be positive if using store" + AS_TORCHRUN)
        if not rank >= 0:
            raise AssertionError("rank must be non-negative if using store" + AS_TORCHRUN)
    acc = torch.accelerator.current_accelerator()
    if isinstance(device_id, int):
        if acc is None:
            raise ValueError("device_id is an int, but no accelerator support is found from "
                             "the current compilation" + AS_TORCHRUN)
        device_id = torch.device(acc.type, device_id)
    if device_id is not None and device_id.type != "cpu":
        if acc is None or device_id.type != acc.type:
            raise ValueError(f"device_id {device_id} does not match the current compilation's "
                             f"accelerator support: {acc}" + AS_TORCHRUN)
        if device_id.index is None:
            raise ValueError("Please use a device_id with index." + AS_TORCHRUN)
        if device_id.index >= torch.accelerator.device_count():
            raise ValueError(f"device_id {device_id} is out of range. Please use a device index "
                             f"less than the number of accelerators available: "
                             f"{torch.accelerator.device_count()}." + AS_TORCHRUN)
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError("Expected timeout argument to be of type datetime.timedelta, got "
                        f"{timeout}" + AS_TORCHRUN)
    if store is None:
        rank, world_size = _rendezvous_check(init_method, rank, world_size)
    if device_id is not None and (device_id.index is None or device_id.type == "cpu"):
        raise ValueError("init_process_group device_id parameter must be an accelerator with "
                         f"an index (device_id={device_id})" + AS_TORCHRUN
                         + "; a CPU group takes no device_id")
    return device_id, rank, world_size


def _refusals(device_id, pg_options) -> list[str]:
    """What the running group cannot be made to honour."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    out = []
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if device_id is not None and device_id != bound:
        out.append(f"device_id={device_id} (the cluster's group is bound to "
                   f"{bound or 'no device'}, and a formed group cannot be re-bound; "
                   "drop device_id, or start with --gpus)")
    if pg_options is not None:
        out.append("pg_options (a formed group's backend options cannot change; drop them, "
                   "dpnb forms the group with the backend's defaults)")
    return out


def hold_timeout(st, seconds: float) -> None:
    """The group timeout a script asked for, for the rest of this cell (the
    script's run): gloo's or NCCL's wait on the default group and the
    collective check's wait for a peer; the cluster's again when the cell ends."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist
    from IPython import get_ipython

    pg = compat.set_group_timeout(seconds)
    guard = st.cell_guard
    star = guard.star if guard is not None else None
    if star is not None:
        star.set_timeout(seconds)
    ip = get_ipython()
    if ip is None:  # no cells here: the timeout holds until the group is re-formed
        return

    def restore(*_result):
        ip.events.unregister("post_run_cell", restore)
        try:
            if dist.is_initialized() and dist.group.WORLD is pg:
                compat.set_group_timeout(st.timeout_s)
            if star is not None and guard.star is star:
                star.set_timeout(st.timeout_s)
        except Exception as e:  # a released group: its re-formation brings the cluster's
            log.warning("restoring the group timeout after a cell failed: %r", e)

    ip.events.register("post_run_cell", restore)


def _adopting(holder: "_Holder"):
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank=-1, store=None, group_name="", pg_options=None,
                           device_id=None, _ranks=None):
        """dpnb: the cluster's group is already up on this rank; joining it (see
        :mod:`dpnb.engine.group.lifecycle`)."""
        # lazy: torch-free at import (boot loads torch in a background thread)
        import torch.distributed as dist

        __tracebackhide__ = True
        st = holder.state
        if not dist.is_initialized():
            raise AdoptError("dpnb's process group is not up on this rank (a re-formation "
                             "failed?): run %dp reform, or %dp restart")
        try:
            device_id, rank, world_size = _as_torch(init_method, timeout, world_size, rank,
                                                    store, device_id)
        except (AssertionError, RuntimeError, TypeError, ValueError) as e:
            e.__traceback__ = None  # the report ends at the script's call, not in dpnb's checks
            raise e from None
        diff = _differences(st, backend, world_size, rank) + _refusals(device_id, pg_options)
        if diff:
            raise AdoptError("init_process_group asks for another group than the cluster's: "
                             + "; ".join(diff) + ". Drop those arguments (RANK, WORLD_SIZE and "
                             "LOCAL_RANK are set as torchrun sets them), or start a cluster "
                             "that matches (%dp stop, then %dp start -n N --backend B)")
        held = ""
        if timeout is not None:
            hold_timeout(st, timeout.total_seconds())
            held = (f"; its timeout ({timeout.total_seconds():g} s) holds until this cell or "
                    f"run ends, then the cluster's {st.timeout_s:g} s")
        _note(f"init_process_group() joined the cluster's running {st.backend} group "
              f"({st.world_size} ranks); nothing was re-initialised{held}")

    init_process_group.__dpnb_original__ = holder.originals["init_process_group"]
    return init_process_group


def _keeping(holder: "_Holder"):
    original = holder.originals["destroy_process_group"]

    def destroy_process_group(group=None):
        """dpnb: the default group stays up for the next cells (see
        :mod:`dpnb.engine.group.lifecycle`); other groups are destroyed."""
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
