"""After a re-formation: what the user holds on the old group is moved to the new one.

A release (a rank raised while others waited, a stuck cell) shuts the
group's connections, and the group is re-formed.  dpnb's own wrap re-binds
itself (:func:`dpnb.engine.train.wrap.rebind`); anything else built on the old
group -- a DDP, ``ZeroRedundancyOptimizer`` or FSDP2 model made in a cell, or
made by a library and kept inside its own objects (a Hugging Face
``Trainer``'s ``model_wrapped`` and its accelerator's ``_models``, Lightning
Fabric's ``_FabricModule._forward_module``, an optimizer wrapper around a
ZeRO optimizer, a list of models) -- would still hold the dead group and fail
at its next collective with ``Connection closed by peer``.

So, right after the new group formed, every rank walks from the names of its
namespace into the objects they hold (:func:`dpnb.core.objwalk.walk`:
``__dict__``, slots, containers; no property or ``__getattr__`` is run) and
finds every object bound to the *old default group*, by what it is, not by
which library made it:

* a ``DistributedDataParallel``: built again **in place** (its constructor
  run on the same object, on the new group; the old reducer's autograd hooks
  removed first; it broadcasts rank 0's parameters, which the ranks share).
  In place, because the object is referenced from places dpnb cannot see or
  should not write -- a Trainer, a Fabric wrapper, a closure, a bound method
  given to a scheduler: a new object under one name would leave all of those
  on the dead group.  Hooks and attributes set on the wrapper, its
  ``train``/``eval`` flag and ``register_comm_hook`` hooks are kept;
* a ``ZeroRedundancyOptimizer``: pointed at the new group in place;
* an FSDP2 module (``fully_shard``) or a ``DeviceMesh`` over the whole
  world: the mesh object pointed at a fresh mesh's group in place; shards
  and optimizer state untouched;
* any attribute, list or dict entry whose value *is* the old group object
  (``self.pg = dist.group.WORLD``): set to the new group.

Building DDP and a mesh are collectives, so the ranks first agree (one
``all_gather_object``) on the paths every rank found with the same kind and
rebuild those, in one order; the others are named in the report.  Objects on
groups the user made with ``new_group`` cannot be rebuilt (the group is gone
with the old world): named too, as are tuple entries (they cannot be
assigned) and a walk cut short by its bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from dpnb import compat
from dpnb.core.objwalk import Hit, instance_dict, walk

log = logging.getLogger(__name__)

_DDP_OPTS = ("device_ids", "output_device", "dim", "broadcast_buffers", "find_unused_parameters",
             "gradient_as_bucket_view", "static_graph", "mixed_precision")
#: rebuilt collectively (every rank must agree on them first)
_COLLECTIVE = ("ddp", "fsdp", "mesh")
#: IPython's own names: they only repeat what the user's names hold
_IPYTHON_NAMES = ("In", "Out", "get_ipython", "exit", "quit")
_DEAD = "built on a group of your own, which the re-formation destroyed; build it again"


@dataclass
class Moved:
    """What a re-formation moved and what it could not, as report lines."""

    moved: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def _classifier(old: Any):
    """``classify`` for the walk: what an object is with respect to ``old``."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def classify(obj: Any) -> tuple[str | None, Any]:
        if isinstance(obj, torch.Tensor):
            return None, False
        if isinstance(obj, dist.ProcessGroup):
            if obj is old:
                return "group", False
            return (None if compat.group_alive(obj) else "dead"), False
        if isinstance(obj, (DDP, ZeroRedundancyOptimizer)):
            kind = "ddp" if isinstance(obj, DDP) else "zero"
            follow = ("_modules",) if kind == "ddp" else False  # its module, not its reducer
            pg = (instance_dict(obj) or {}).get("process_group")
            if pg is old:
                return kind, follow
            return (None if pg is None or compat.group_alive(pg) else "dead"), follow
        if isinstance(obj, FSDPModule):  # its meshes cover every fully_shard unit under it
            infos = compat.fsdp_mesh_infos(obj)
            stale = any(compat.mesh_info_group(i) is old for i in infos)
            return ("fsdp" if stale else None), False
        if isinstance(obj, DeviceMesh):
            return ("mesh" if compat.mesh_is_stale(obj) else None), False
        return None, True

    return classify


def _roots(ns: dict) -> list[str]:
    return [n for n in ns if not n.startswith("_") and n not in _IPYTHON_NAMES]


def _label(hit: Hit) -> str:
    also = [s.path for s in hit.slots[1:4]]
    return hit.path + (f" (also {', '.join(also)})" if also else "")


def rebuild_ddp_in_place(ddp: Any, old: Any) -> None:
    """Run ``DistributedDataParallel.__init__`` again on ``ddp``, on the new group.

    The same object, so every reference to it stays valid.  The
    constructor resets what ``nn.Module.__init__`` sets; the wrapper's own
    hooks (a library's forward hooks), its ``training`` flag and the comm
    hooks registered on it are put back.  Collective (parameter broadcast).
    """
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    d = instance_dict(ddp)
    opts = {k: d[k] for k in _DDP_OPTS if k in d}
    if d.get("bucket_bytes_cap"):
        opts["bucket_cap_mb"] = d["bucket_bytes_cap"] / 2**20
    before = dict(d)
    compat.remove_ddp_hooks(ddp)
    DDP.__init__(ddp, before["_modules"]["module"], process_group=dist.group.WORLD, **opts)
    for k, v in before.items():
        if k.endswith("hooks") and isinstance(v, dict) and isinstance(d.get(k), dict):
            for hid, hook in v.items():
                d[k].setdefault(hid, hook)
    d["training"] = before.get("training", True)
    present = {id(h) for h, _ in d.get("_comm_hooks", [])}
    for hook, state in before.get("_comm_hooks", []):
        if id(hook) not in present:
            ddp.register_comm_hook(dist.group.WORLD if state is old else state, hook)


def _apply(hit: Hit, old: Any, fresh_mesh) -> str | None:
    """Move one agreed object; the report line, or None if nothing to say."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    if hit.kind == "ddp":
        rebuild_ddp_in_place(hit.obj, old)
        return f"{_label(hit)}: DistributedDataParallel rebuilt in place (same object)"
    if hit.kind == "zero":
        compat.point_zero_at_group(hit.obj, dist.group.WORLD)
        return f"{_label(hit)}: ZeroRedundancyOptimizer pointed at the new group"
    if hit.kind == "fsdp":
        mesh = fresh_mesh()
        for info in compat.fsdp_mesh_infos(hit.obj):
            compat.rebind_mesh(info.mesh, mesh)
            compat.refresh_mesh_info(info)
        return f"{_label(hit)}: FSDP2 mesh pointed at the new group"
    if hit.kind == "mesh":
        if tuple(hit.obj.shape) != (dist.get_world_size(),):
            return None  # named in the left list by the caller
        compat.rebind_mesh(hit.obj, fresh_mesh())
        return f"{_label(hit)}: DeviceMesh pointed at the new group"
    raise ValueError(f"unknown kind {hit.kind}")


def _groups(hits: list[Hit], out: Moved) -> None:
    """The old group object itself, wherever it is held: replaced (local, no collective)."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    for hit in hits:
        if hit.kind == "zero":
            out.moved.append(_apply(hit, None, None))
        elif hit.kind == "dead":
            out.left.append(f"{_label(hit)}: {_DEAD}")
        elif hit.kind == "group":
            done = [s.path for s in hit.slots if s.assign(dist.group.WORLD)]
            fixed = [s.path for s in hit.slots if s.path not in done]
            if done:
                out.moved.append(f"{', '.join(done)}: the new group")
            if fixed:
                out.left.append(f"{', '.join(fixed)}: the old group, in a tuple or set "
                                "(cannot be assigned)")


def rebind_user_objects(ns: dict, old: Any, device_type: str = "cpu") -> Moved:
    """Move what the namespace holds from ``old`` (the destroyed default group)
    to the new one (meshes on ``device_type``).  Collective: every rank calls
    it, right after the group formed."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    found = walk(ns, _classifier(old), names=_roots(ns))
    out = Moved()
    if found.truncated:
        out.left.append(f"whatever is held beyond the search's bounds ({found.max_depth} "
                        f"levels deep, {found.max_objects} objects)")
    mine = {h.path: h.kind for h in found.hits if h.kind in _COLLECTIVE}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    common = {p for p, k in mine.items() if all(o.get(p) == k for o in everyone)}
    meshes: list = []

    def fresh_mesh():
        if not meshes:  # one fresh mesh for them all (collective, so made once, in order)
            # lazy: torch-free at import (boot loads torch in a background thread)
            from torch.distributed.device_mesh import init_device_mesh

            meshes.append(init_device_mesh(device_type, (dist.get_world_size(),)))
        return meshes[0]

    for hit in sorted((h for h in found.hits if h.path in common), key=lambda h: h.path):
        line = _apply(hit, old, fresh_mesh)
        if line is None:
            out.left.append(f"{_label(hit)}: a DeviceMesh of another shape than the world; "
                            "build it again")
        else:
            out.moved.append(line)
    _groups([h for h in found.hits if h.kind not in _COLLECTIVE], out)
    left = sorted(set(mine) - common)
    if left:
        out.left.append(f"not found on every rank, so not rebuilt: {', '.join(left)}")
    return out
