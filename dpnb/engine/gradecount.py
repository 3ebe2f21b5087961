"""What a graded function sent and what it left alive, measured below torch.distributed's names.

Counting by Python function name (wrapping ``dist.send``, ``dist.all_reduce``
...) misses whole families of calls a learner makes: a process group's own
methods (``dist.group.WORLD.allreduce([t])``), functional collectives
(``torch.distributed._functional_collectives``), ``gather`` / ``scatter`` /
``all_to_all``, ``batch_isend_irecv`` and the ``*_object`` calls.  Every one
of them reaches the dispatcher as a ``c10d`` or ``_c10d_functional``
operator, so :class:`Counting` is a ``TorchDispatchMode``: it sees each such
operator once, on this thread and on the autograd threads that run a DDP
comm hook (the dispatch mode travels with autograd's thread-local state;
measured on torch 2.12 and 2.13 with gloo).  A learner's own thread, started
inside the case, is not counted (its collectives are then missed); nor is a
process group's traffic after the learner deliberately leaves the mode
(``torch._C._unset_dispatch_mode``) -- what a submission can still do is in
the README's grading section.

The cell guard's own traffic (the header it sends before each send, to
catch a size mismatch before gloo aborts) is not the learner's and is left
out.  Each operator is counted under the torch.distributed name a learner knows
(``c10d::allreduce_`` is ``all_reduce``) with the bytes it concerns: for a
collective costed as a ring, its full buffer (:func:`dpnb.core.grading.sent_bytes`
costs it); for a send, gather, scatter or all-to-all, the bytes that left this
rank.

:func:`kept_storages` is the memory side: every tensor storage the learner
can still reach after the step -- from the namespace (a global, an object's
attribute, a list or dict in it), from a function's closure or defaults,
and from ``state`` -- so a momentum kept in a global counts as much as one
kept in ``state``.  A walk from those roots (:mod:`dpnb.core.objwalk`), not
every tensor alive in the process: a buffer a collective's worker thread
has not yet let go of is not the learner's memory.  :func:`alive_storages`
(every storage a Python object keeps, ``gc``) tells which of them are new.
"""

from __future__ import annotations

import gc
import logging
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpnb.core.objwalk import walk
from dpnb.engine.cell.p2pcheck import META_TAG_BIT

log = logging.getLogger(__name__)


def tensor_bytes(t) -> int:
    """A tensor's bytes (0 for anything else)."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _all(ts) -> int:
    """Bytes of a tensor, a list of them, or a list of lists."""
    if isinstance(ts, torch.Tensor):
        return tensor_bytes(ts)
    return sum(_all(t) for t in ts or ())


def _others(ts, me: int) -> int:
    """Bytes of a per-rank list but this rank's own entry (it never leaves)."""
    return sum(_all(t) for i, t in enumerate(ts or ()) if i != me)


def _split_sent(inp, splits, me: int, n: int) -> int:
    """What ``all_to_all_single`` sends: every split but this rank's own."""
    total = tensor_bytes(inp)
    if not splits:
        return total * (n - 1) // n
    per = total // max(1, sum(splits))
    return sum(s * per for i, s in enumerate(splits) if i != me)


def _counted(op: str, a: tuple, rank: int, n: int) -> tuple[str, int] | None:
    """(the torch.distributed name, bytes) for one c10d operator call, None if not communication."""
    if op in ("c10d::allreduce_", "c10d::allreduce_coalesced_"):
        return "all_reduce", _all(a[0])
    if op == "c10d::broadcast_":
        return "broadcast", _all(a[0])
    if op == "c10d::reduce_":
        return "reduce", _all(a[0])
    if op in ("c10d::allgather_", "c10d::allgather_coalesced_"):
        return "all_gather", _all(a[0][0] if a[0] else ())
    if op in ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_"):
        return "all_gather_into_tensor", _all(a[0])
    if op == "c10d::reduce_scatter_":
        return "reduce_scatter", _all(a[1][0] if a[1] else ())
    if op in ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_"):
        return "reduce_scatter_tensor", _all(a[1])
    if op == "c10d::gather_":  # every rank but the root sends its input to the root
        return "gather", 0 if a[3] == rank else _all(a[1])
    if op == "c10d::scatter_":  # the root sends every other rank its piece
        return "scatter", _others(a[1][0] if a[1] else (), rank) if a[3] == rank else 0
    if op == "c10d::alltoall_":
        return "all_to_all", _others(a[1], rank)
    if op == "c10d::alltoall_base_":
        return "all_to_all_single", _split_sent(a[1], list(a[4] or ()), rank, n)
    if op == "c10d::send":
        if int(a[3]) & META_TAG_BIT:  # the cell guard's header before each send, not the learner's
            return None
        return "send", _all(a[0])
    if op in ("c10d::recv_", "c10d::recv_any_source_"):
        return "recv", 0
    if op in ("c10d::barrier", "c10d::monitored_barrier_"):
        return "barrier", 0
    if op.startswith("_c10d_functional::"):
        name = op.split("::", 1)[1].rstrip("_")
        if name in ("all_reduce", "all_reduce_coalesced"):
            return "all_reduce", _all(a[0])
        if name.startswith("all_gather_into_tensor"):
            return "all_gather_into_tensor", _all(a[0]) * int(a[1])
        if name.startswith("reduce_scatter_tensor"):
            return "reduce_scatter_tensor", _all(a[0])
        if name == "all_to_all_single":
            return "all_to_all_single", _split_sent(a[0], list(a[2] or ()), rank, n)
        if name == "broadcast":
            return "broadcast", _all(a[0])
        return None  # wait_tensor, _wrap_tensor_autograd: no bytes of their own
    if op.startswith("c10d::"):
        log.info("grading: c10d operator %s counted without bytes", op)
        return op.split("::", 1)[1].rstrip("_"), 0
    return None


class Counting(TorchDispatchMode):
    """Counts every c10d operator dispatched while it is on: ``counts[name] = [calls, bytes]``.

    ``launch_delay_s`` (0 unless a runner sets it): how long each c10d operator
    waits before it is handed to the process group.  It is below dpnb's collective check (the ranks have all
    reached the call) and above gloo, so on the rank that has it set, the
    collective starts that much later than on the others -- and theirs cannot
    finish before it does (the hook exercise's overlap check)."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world
        self.launch_delay_s = 0.0
        self.counts: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and self.launch_delay_s:
            time.sleep(self.launch_delay_s)
        if func.namespace in ("c10d", "_c10d_functional"):
            op = func._schema.name  # "c10d::allreduce_", whatever the overload
            try:
                got = _counted(op, tuple(args), self.rank, self.world)
            except (IndexError, TypeError, AttributeError) as e:  # an operator's schema moved
                log.warning("grading: could not read %s's arguments (%s): counted without bytes",
                            func, e)
                got = (op.split("::", 1)[1].rstrip("_"), 0)
            if got is not None:
                c = self.counts.setdefault(got[0], [0, 0])
                c[0] += 1
                c[1] += got[1]
        return func(*args, **(kwargs or {}))


def storages(tensors) -> dict[int, int]:
    """The storages ``tensors`` (and their ``.grad``) keep alive: data pointer -> bytes."""
    out: dict[int, int] = {}
    for o in tensors:
        for t in (o, o.grad if o.is_leaf else None):
            if t is None:
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested, fake: no one storage
                continue
            if s.data_ptr():
                out[s.data_ptr()] = s.nbytes()
    return out


def alive_storages() -> dict[int, int]:
    """Every storage a Python-visible tensor (or its ``.grad``) keeps alive: data pointer -> bytes."""
    gc.collect()
    return storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _tensor_kind(obj):
    return ("tensor", False) if isinstance(obj, torch.Tensor) else (None, True)


def kept_storages(ns: dict, state) -> dict[int, int]:
    """The storages of every tensor reachable from the namespace's user objects,
    the closures and defaults of its functions, and ``state``: pointer -> bytes."""
    roots: dict[str, object] = {"state": state}
    for k, v in ns.items():
        if k.startswith("_") or isinstance(v, types.ModuleType):
            continue
        roots[k] = v
        if isinstance(v, types.FunctionType):  # a leaf to the walk: its captures are not
            roots[f"{k}.__closure__"] = [c.cell_contents for c in v.__closure__ or ()
                                         if _filled(c)]
            roots[f"{k}.__defaults__"] = list(v.__defaults__ or ())
    return storages(hit.obj for hit in walk(roots, _tensor_kind, max_depth=8,
                                            max_objects=50_000).hits)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def storages_of(*objs) -> set[int]:
    """The data pointers of the storages of the tensors in ``objs`` (lists walked)."""
    out: set[int] = set()
    stack = list(objs)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.add(v.untyped_storage().data_ptr())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out
