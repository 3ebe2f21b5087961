"""After a re-formation: what the user built on the old group is moved to the new one.

A release (a rank raised while others waited, a stuck cell) shuts the
group's connections, and the group is re-formed.  dpnb's own wrap re-binds
itself (:func:`dpnb.engine.wrap.rebind`); a DDP, ``ZeroRedundancyOptimizer``
or FSDP2 model the user built in a cell (or that Accelerate's ``prepare``
built) would still hold the dead group and fail at its next step.  So, right
after the new group formed, every rank looks at the top-level names of its
namespace for such objects bound to the *old default group*, and:

* ``DistributedDataParallel``: a new DDP with the same settings around the
  same module, under the same names (the old one's autograd hooks removed;
  the new one broadcasts rank 0's parameters, which the ranks share);
  ``ddp.register_comm_hook`` hooks are not carried over (said in the note);
* ``ZeroRedundancyOptimizer``: pointed at the new group in place;
* an FSDP2 module (``fully_shard``): its device mesh pointed at a fresh one
  in place; shards and optimizer state untouched.

Re-binding is collective, so the ranks first agree (one ``all_gather_object``)
on the names every rank holds with the same kind, and re-bind those, in one
order; the rest are named in the note.  Objects on groups the user made with
``new_group`` cannot be rebuilt (the group is gone); they are named too.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import compat

log = logging.getLogger(__name__)

_DDP_OPTS = ("device_ids", "output_device", "dim", "broadcast_buffers", "find_unused_parameters",
             "gradient_as_bucket_view", "static_graph", "mixed_precision")


def _kind(obj: Any, old: Any) -> str | None:
    """``ddp`` / ``zero`` / ``fsdp`` for an object on the old default group,
    ``...-subgroup`` for one on another dead group, None otherwise."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP


    if isinstance(obj, (DDP, ZeroRedundancyOptimizer)):
        kind = "ddp" if isinstance(obj, DDP) else "zero"
        pg = obj.process_group
        if pg is old:
            return kind
        return None if pg is dist.group.WORLD else f"{kind}-subgroup"
    if isinstance(obj, FSDPModule):
        infos = compat.fsdp_mesh_infos(obj)
        return "fsdp" if any(compat.mesh_info_group(i) is old for i in infos) else None
    return None


def _found(ns: dict, old: Any) -> dict[str, str]:
    out = {}
    for name, obj in list(ns.items()):
        if name.startswith("_"):
            continue
        try:
            kind = _kind(obj, old)
        except Exception as e:  # an odd object whose checks raise: leave it be
            log.debug("not re-binding %s: %s: %s", name, type(e).__name__, e)
            continue
        if kind:
            out[name] = kind
    return out


def _new_ddp(old_ddp):
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    opts = {k: getattr(old_ddp, k) for k in _DDP_OPTS if hasattr(old_ddp, k)}
    cap = getattr(old_ddp, "bucket_bytes_cap", None)
    if cap:
        opts["bucket_cap_mb"] = cap / 2**20
    compat.remove_ddp_hooks(old_ddp)
    return DDP(old_ddp.module, process_group=dist.group.WORLD, **opts)


def rebind_user_objects(ns: dict, old: Any) -> list[str]:
    """Re-bind the user's DDP / ZeRO / FSDP objects from ``old`` (the destroyed
    default group) to the new one.  Collective.  Returns notes for the report."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist


    mine = _found(ns, old)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    common = {n: k for n, k in mine.items() if all(o.get(n) == k for o in everyone)}
    notes = []
    fresh_mesh = None
    done: dict[int, Any] = {}
    for name in sorted(common):
        kind, obj = common[name], ns[name]
        if id(obj) in done:  # the same object under a second name
            ns[name] = done[id(obj)]
            continue
        if kind == "ddp":
            ns[name] = done[id(obj)] = _new_ddp(obj)
            notes.append(f"{name}: a new DistributedDataParallel around the same module")
        elif kind == "zero":
            compat.point_zero_at_group(obj, dist.group.WORLD)
            notes.append(f"{name}: ZeroRedundancyOptimizer pointed at the new group")
        elif kind == "fsdp":
            if fresh_mesh is None:
                # lazy: torch-free at import (boot loads torch in a background thread)
                from torch.distributed.device_mesh import init_device_mesh

                dev = next((p.device.type for p in obj.parameters()), "cpu")
                fresh_mesh = init_device_mesh(dev, (dist.get_world_size(),))
            for info in compat.fsdp_mesh_infos(obj):
                compat.rebind_mesh(info.mesh, fresh_mesh)
                compat.refresh_mesh_info(info)
            notes.append(f"{name}: FSDP2 mesh pointed at the new group")
        else:  # on a group the user made: it is gone with the old world
            notes.append(f"{name}: built on a group of your own, which the re-formation "
                         f"destroyed; build it again")
    left = sorted(set(mine) - set(common))
    if left:
        notes.append(f"not on every rank, so not re-bound: {', '.join(left)}")
    return notes
