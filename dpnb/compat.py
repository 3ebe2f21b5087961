"""Every private internal of torch that dpnb touches, in one place.

(ipyparallel's and ipykernel's are in :mod:`dpnb.ippcompat`.)

dpnb re-binds live DDP / ZeRO-1 / FSDP2 objects to a re-formed process group
and times FSDP2's collectives; torch has no public API for either, so these
functions reach into its internals.  Keeping them here means a torch upgrade
that renames one breaks one function with a clear message, and
``tests/unit/test_compat.py`` checks every one of them against the installed
versions (:func:`check_torch`).

torch is imported inside the functions: the notebook side imports this module
without importing torch.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)


class CompatError(RuntimeError):
    """An internal dpnb relies on is missing in the installed torch / ipyparallel."""


def _need(obj: Any, attr: str, what: str) -> Any:
    try:
        return getattr(obj, attr)
    except AttributeError:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        import torch

        raise CompatError(
            f"{what}: {type(obj).__name__}.{attr} is missing in torch {torch.__version__}; "
            "this dpnb does not support that torch version (update dpnb or pin torch)") from None


# -------------------------------------------------------------- c10d groups
def rendezvous_schemes() -> frozenset[str]:
    """The ``init_method`` URL schemes torch can rendezvous with (``env``, ``tcp``,
    ``file`` and any registered)."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import importlib

    mod = importlib.import_module("torch.distributed.rendezvous")  # the module, not its function
    return frozenset(_need(mod, "_rendezvous_handlers", "checking an init_method URL"))


def _set_pg_timeouts(seconds: float, groups: list, why: str) -> None:
    """``seconds`` as the collective timeout of each of ``groups`` (gloo and
    NCCL backends), from now on.  torch has no public way to change a formed
    group's timeout."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d  # lazy: as above

    fn = _need(c10d, "_set_pg_timeout", why)
    for g in groups:
        fn(timedelta(seconds=seconds), g)


def set_group_timeout(seconds: float) -> Any:
    """Set the default group's collective timeout to ``seconds``; returns the group."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    _set_pg_timeouts(seconds, [pg], "a script's init_process_group(timeout=...)")
    return pg


def set_other_groups_timeout(seconds: float) -> int:
    """Set every live group's timeout but the default group's to ``seconds``
    (what torch's ``dist.breakpoint`` does to every group); returns how many."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    others = [g for g in _need(c10d, "_world", "live groups").pg_map if g is not world]
    _set_pg_timeouts(seconds, others, "dist.breakpoint(timeout_s=...)")
    return len(others)


def abort_groups() -> bool:
    """Abort every process group of this process (NCCL: from any thread)."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed import distributed_c10d as c10d

    try:
        _need(c10d, "_abort_process_group", "aborting NCCL groups")()
    except (RuntimeError, ValueError) as e:  # already torn down (a second release: ValueError)
        log.info("abort of the process groups: %s: %s", type(e).__name__, e)
        return False
    return True


def group_error(pg: Any = None) -> str | None:
    """The error torch's NCCL watchdog recorded on ``pg``'s communicator
    (default: the default group): ``"TIMEOUT"``, ``"COMM_ERROR"`` or
    ``"REMOTE_ERROR"``; ``None`` when it saw none, or ``pg`` has no NCCL side.

    With ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (dpnb's setting) the watchdog
    thread, on a collective that outlived the group timeout or failed, sets
    this error and then aborts the communicators: the rank's queued kernels
    end early, as after dpnb's own release, but nothing in Python is told.
    ``ProcessGroupNCCL.get_error()`` reads one field under a mutex (no
    device or store call), so the optimizer-step gate can ask every step.
    The error stays set until the group is re-formed (a new group, a clean
    error): an aborted communicator reduces nothing any more.
    """
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import torch
    from torch.distributed import distributed_c10d as c10d  # lazy: as above

    pg = c10d.GroupMember.WORLD if pg is None else pg
    if pg is None:  # no default group (a release under NCCL empties c10d's map)
        return None
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # a group without a CUDA backend (gloo): no watchdog
        return None
    get = getattr(backend, "get_error", None)  # ProcessGroupNCCL (and its wrapper) only
    if get is None:
        return None
    err = get()
    name = getattr(err, "name", str(err))
    return None if name == "SUCCESS" else name


def group_alive(pg: Any) -> bool:
    """Whether a process group object is one of this process's current groups
    (after a re-formation, every group of the old world is destroyed)."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed import distributed_c10d as c10d

    return pg in _need(_need(c10d, "_world", "telling live groups"), "pg_map", "telling live groups")


def mesh_is_stale(mesh: Any) -> bool:
    """Whether a ``DeviceMesh`` names a destroyed process group."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed import distributed_c10d as c10d

    registry = getattr(mesh, "_pg_registry", None)  # torch 2.13: the mesh's own groups
    if isinstance(registry, dict) and registry:
        return not all(group_alive(g) for g in registry.values())
    live = set(_need(c10d._world, "pg_names", "telling live groups").values())
    return not set(_need(mesh, "_dim_group_names", "reading a DeviceMesh")) <= live


# ------------------------------------------------------------------ DTensor
#: torch 2.13 renamed two collectives and deprecated the old names (FutureWarning)
SINGLE_COLLECTIVES = (("reduce_scatter_single", "reduce_scatter_tensor"),
                      ("all_gather_single", "all_gather_into_tensor"))


def ensure_single_collectives() -> list[str]:
    """Give torch < 2.13 the new names ``dist.reduce_scatter_single`` and
    ``dist.all_gather_single`` (aliases of the old ones, same arguments), so
    code written for the current names -- the course's and dpnb's own -- runs
    on every torch dpnb supports without warnings.  Returns the names added."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import torch.distributed as dist

    added = []
    for new, old in SINGLE_COLLECTIVES:
        if not hasattr(dist, new):
            setattr(dist, new, _need(dist, old, "torch.distributed collective"))
            added.append(new)
    return added


def source_rank(work: Any) -> int:
    """The rank a receive from any source was matched with (torch's private
    ``Work._source_rank``; ``recv`` itself reads it the same way)."""
    return _need(work, "_source_rank", "point-to-point check, recv from any source")()


def local_tensor(t: Any) -> Any:
    """The part of ``t`` stored on this rank: a DTensor's local shard, else ``t``.

    ``_local_tensor`` rather than ``to_local()``: the latter goes through
    autograd, and the callers count storage or copy shards without grads.
    """
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "_local_tensor")


# ---------------------------------------------------------------------- DDP
def remove_ddp_hooks(ddp: Any) -> None:
    """Drop the autograd hooks an old ``DistributedDataParallel`` left on the
    module's parameters, so a new DDP around the same module does not
    all-reduce every gradient twice (once through a dead group)."""
    remove = getattr(ddp, "_remove_autograd_hooks", None)
    if remove is None:
        return
    try:
        remove()
    except RuntimeError as e:  # the reducer of a broken group can refuse; the hooks go with it
        log.warning("removing DDP autograd hooks failed (%s); continuing with a new wrapper", e)


def point_zero_at_group(zo: Any, group: Any) -> None:
    """Make a ``ZeroRedundancyOptimizer`` use ``group`` (same world size).

    Its partition depends only on the world size, which a re-formed group
    keeps, so the state stays valid; only the group handle and the cached
    ranks change.
    """
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import torch.distributed as dist

    for attr in ("process_group", "world_size", "rank", "global_rank"):
        _need(zo, attr, "re-binding ZeroRedundancyOptimizer")
    zo.process_group = group
    zo.world_size = dist.get_world_size(group)
    zo.rank = dist.get_rank(group)
    zo.global_rank = dist.distributed_c10d.get_global_rank(group, zo.rank)


def zero_inner_optimizer(zo: Any) -> Any:
    """The local optimizer a ``ZeroRedundancyOptimizer`` steps (its ``optim``)."""
    return _need(zo, "optim", "reading ZeroRedundancyOptimizer state")


# -------------------------------------------------------------------- FSDP2
def fsdp_param_groups(module: Any) -> Iterator[Any]:
    """Every FSDP2 param group (one per ``fully_shard`` unit) under ``module``."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = _need(m, "_get_fsdp_state", "reading FSDP2 state")()
            yield from getattr(state, "_fsdp_param_groups", None) or []


def fsdp_mesh_infos(module: Any) -> list:
    """FSDP2's mesh-info objects (they cache the process group) under ``module``."""
    infos: dict = {}
    for pg in fsdp_param_groups(module):
        cands = [pg.mesh_info, pg.post_forward_mesh_info]
        for fp in pg.fsdp_params:
            cands += [getattr(fp, "mesh_info", None), getattr(fp, "post_forward_mesh_info", None)]
        for info in cands:
            if info is not None:
                infos[id(info)] = info
    return list(infos.values())


def rebind_mesh(mesh: Any, fresh: Any) -> None:
    """Point an existing ``DeviceMesh`` at the process group of ``fresh``.

    FSDP2's DTensor parameters, their optimizer state and its param groups all
    refer to one mesh object; copying the new mesh's group names into it
    re-binds them all without touching a shard.
    """
    mesh._dim_group_names = list(_need(fresh, "_dim_group_names", "re-binding a DeviceMesh"))
    reg = getattr(mesh, "_pg_registry", None)
    if isinstance(reg, dict):
        reg.clear()
        reg.update(getattr(fresh, "_pg_registry", {}) or {})


def mesh_info_group(info: Any) -> Any:
    """The process group an FSDP mesh-info object cached when it was built
    (its mesh, asked now, names the current group instead)."""
    return getattr(info, "shard_process_group", None)


def refresh_mesh_info(info: Any) -> None:
    """Recompute the process group an FSDP mesh-info object caches."""
    info.__post_init__()


def fsdp_default_comms() -> tuple[type, type]:
    """FSDP2's default all-gather and reduce-scatter classes (subclassed to time them)."""
    try:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError as e:
        raise CompatError(f"timing FSDP2 collectives: {e}; this torch is not supported") from None
    return DefaultAllGather, DefaultReduceScatter


def fsdp_group_phase(pg: Any) -> str:
    """``forward`` or ``backward``: what an FSDP2 param group is doing now."""
    state = getattr(pg, "_training_state", None)
    return "forward" if getattr(state, "name", "") == "FORWARD" else "backward"


def fsdp_group_unit(pg: Any) -> str:
    """The module path of an FSDP2 param group's unit (set at lazy init)."""
    return getattr(pg, "_module_fqn", None) or "(root)"


def set_fsdp_comms(pg: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Replace an FSDP2 param group's collective objects."""
    _need(pg, "_all_gather_comm", "timing FSDP2 collectives")
    _need(pg, "_reduce_scatter_comm", "timing FSDP2 collectives")
    pg._all_gather_comm = all_gather
    pg._reduce_scatter_comm = reduce_scatter


# ------------------------------------------------------------------- checks
def check_torch() -> list[str]:
    """Problems with the torch internals above, checked on live objects.

    Needs an initialised default process group (world size 1 is enough):
    builds a tiny DDP model, a ZeroRedundancyOptimizer and an FSDP2 model on
    it and looks for every attribute this module touches.
    """
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    v = torch.__version__
    probs: list[str] = []
    if dist.is_nccl_available():
        nccl = getattr(dist.distributed_c10d, "ProcessGroupNCCL", None)
        if nccl is None or not hasattr(nccl, "get_error"):
            probs.append(f"torch {v}: ProcessGroupNCCL has no get_error (the optimizer-step "
                         "gate cannot see the watchdog's abort)")
    if not hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        probs.append(f"torch {v}: distributed_c10d has no _set_pg_timeout")
    if "env" not in rendezvous_schemes():
        probs.append(f"torch {v}: no env:// among the rendezvous handlers")

    def need(obj: Any, attr: str, what: str) -> None:
        if not hasattr(obj, attr):
            probs.append(f"torch {v}: {what} has no {attr}")

    ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
    need(ddp, "_remove_autograd_hooks", "DistributedDataParallel")
    zo = ZeroRedundancyOptimizer(list(torch.nn.Linear(2, 2).parameters()),
                                 optimizer_class=torch.optim.SGD, lr=0.1)
    for attr in ("optim", "process_group", "world_size", "rank", "global_rank"):
        need(zo, attr, "ZeroRedundancyOptimizer")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    need(mesh, "_dim_group_names", "DeviceMesh")
    try:
        if not group_alive(dist.group.WORLD) or mesh_is_stale(mesh):
            probs.append(f"torch {v}: live process groups are not told from destroyed ones")
    except CompatError as e:
        probs.append(str(e))
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    need(FSDPModule, "_get_fsdp_state", "FSDPModule")
    try:
        fsdp_default_comms()
        groups = list(fsdp_param_groups(net))
    except CompatError as e:
        return probs + [str(e)]
    if not groups:
        probs.append(f"torch {v}: FSDP2 state has no _fsdp_param_groups")
    for pg in groups[:1]:
        for attr in ("_all_gather_comm", "_reduce_scatter_comm", "_training_state",
                     "mesh_info", "post_forward_mesh_info", "fsdp_params"):
            need(pg, attr, "an FSDP2 param group")
        infos = fsdp_mesh_infos(net)
        if not infos or not all(hasattr(i, "__post_init__") for i in infos):
            probs.append(f"torch {v}: FSDP2 mesh infos cannot be refreshed")
        if infos and mesh_info_group(infos[0]) is None:
            probs.append(f"torch {v}: FSDP2 mesh infos cache no shard_process_group")
        if not any(is_dtensor(p) for p in net.parameters()):
            probs.append(f"torch {v}: FSDP2 parameters are not DTensors with _local_tensor")
    return probs
