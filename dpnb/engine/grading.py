"""The ranks' side of ``%dp grade``: run the learner's function on one case, measure.

The notebook calls :func:`run_case` on every rank at once
(:mod:`dpnb.session.grading`), one case per call.  Each rank builds its own
input from a seed that names the rank, so every rank can also compute the
reference for *all* ranks locally (no communication is trusted to check
communication), calls the function the learner defined under ``name`` in the
engine's namespace, and reports: how far its result is from the reference,
each communication operator it dispatched with its bytes, counted below
torch.distributed's Python names (:mod:`dpnb.engine.gradecount`: the
notebook costs collectives as rings, :func:`dpnb.core.grading.sent_bytes`),
and for ZeRO the bytes of every tensor the step created that is still alive
after it, wherever the learner keeps it.  The exercise itself (an
:class:`dpnb.core.assignment.Exercise`, from the instructor's assignment)
travels with each call: its cases and reference never live in the student's
package.

While a case runs, the cell guard checks its calls as in a ``%%dp`` cell
(:mod:`dpnb.engine.cell.cellguard`): a send / recv pair of different sizes is a
:class:`~dpnb.engine.cell.p2pcheck.PointToPointMismatchError` on both ranks, not
gloo's abort.  A deadlock or an endless loop is the notebook's call timeout:
the ranks are interrupted and their group released
(:mod:`dpnb.cluster.waiting`), as a ``%%dp --timeout`` cell is.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dpnb.core.assignment import Exercise
from dpnb.core.grading import RTOL, ZERO1_LR, ZERO1_MOMENTUM, ZERO1_STEPS, exercise
from dpnb.engine.gradecount import (Counting, alive_storages, kept_storages, storages,
                                     storages_of, tensor_bytes)
from dpnb.engine.state import get_state


@contextlib.contextmanager
def checked(ns: dict):
    """The cell guard on, as for a ``%%dp`` cell, while the case runs (a
    dotted-name call is otherwise passed through unchecked)."""
    st = get_state(ns)
    g = st.cell_guard
    if g is None:
        yield
        return
    saved = (g.active, g.checking, g.depth)
    st.cell_calls = {}
    g.active, g.checking, g.depth = True, True, 0
    if g.star is not None:
        g.star.reset_cell()  # every rank starts the case's call history afresh
    try:
        yield
    finally:
        g.active, g.checking, g.depth = saved
        st.current_collective = None


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far ``got`` is from ``ref``: elements off, the largest error, and
    ``ratio`` (least squares got/ref: N where a sum was due as an average)."""
    got, ref = got.detach().flatten().double(), ref.detach().flatten().double()
    if got.numel() != ref.numel():
        return {"bad": ref.numel(), "numel": ref.numel(), "max_err": float("inf"), "ratio": None}
    err = (got - ref).abs()
    bad = int((err > RTOL * (1 + ref.abs()) * 10).sum())
    denom = float(ref @ ref)
    ratio = float(got @ ref) / denom if denom else None
    # the whole result a multiple of the reference (a sum where an average was due)?
    scaled = ratio is not None and bool(((got - ratio * ref).abs()
                                         <= RTOL * (1 + (ratio * ref).abs()) * 10).all())
    return {"bad": bad, "numel": ref.numel(), "max_err": float(err.max()) if err.numel() else 0.0,
            "ratio": ratio, "scaled": scaled}


def _reference(ex: Exercise):
    """The assignment's ``reference(inputs, rank)``, compiled apart from the learner's namespace."""
    env = {"torch": torch, "math": math, "__name__": "dpnb_reference"}
    exec(compile(ex.reference, f"<reference of {ex.key}>", "exec"), env)
    return env["reference"]


def _tensor(fn, ex: Exercise, case, rank: int, world: int, dev, mode: Counting,
            ns: dict) -> dict:
    """``fn(t)`` on this rank's own tensor; in place, or the tensor it returns."""
    shape = tuple(case)
    inputs = [_randn(shape, 1000 + r) for r in range(world)]
    t = inputs[rank].clone().to(dev)  # a copy: the reference below reads the inputs
    with mode:
        out = fn(t)
    got = out if isinstance(out, torch.Tensor) else t
    ref = _reference(ex)([x.clone() for x in inputs], rank)
    return {"values": compare(got.detach().cpu(), ref), "tensor_bytes": tensor_bytes(t)}


def _net(d_in: int, d_hid: int, d_out: int) -> torch.nn.Module:
    """The same small model on every rank (its own generator: the learner's seed is kept)."""
    m = torch.nn.Sequential(torch.nn.Linear(d_in, d_hid), torch.nn.Tanh(),
                            torch.nn.Linear(d_hid, d_out))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(_randn(p.shape, 5000 + i) * 0.3)
    return m


def _grads(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in m.parameters()])


#: how much later the last rank's part of each bucket's collective reaches gloo in the
#: hook exercise (see ``_hook``: rank 0's launched all-reduce is still running when a
#: hook that does not wait returns, however fast the link and the machine)
HOOK_LATE_S = 0.5


def _hook(fn, ex: Exercise, case, rank: int, world: int, dev, mode: Counting,
          ns: dict) -> dict:
    """A DDP model whose buckets go through the learner's hook; its gradients
    against every rank's gradient averaged, computed here without DDP."""
    d_in, d_hid, d_out, cap_mb = case
    kinds: list[str] = []
    pending: list[bool] = []  # per bucket: was its communication still running at return?

    def spy(state, bucket):
        fut = fn(state, bucket)
        # torch.futures.Future or the C future .get_future() gives (its base): duck-typed
        ok = all(callable(getattr(fut, a, None)) for a in ("wait", "then", "value"))
        kinds.append("Future" if ok else type(fut).__name__)
        if not ok:
            raise TypeError(f"the hook returned {type(fut).__name__}, not a "
                            "torch.futures.Future: DDP waits on the future the hook returns")
        # a hook that waits for its own all-reduce returns a finished future: backward
        # stood still while the bucket was sent (no overlap).  One that does not
        # wait returns it unfinished on rank 0, always: the last rank hands its part
        # to gloo HOOK_LATE_S after the others (``mode.launch_delay_s`` below), so
        # theirs cannot finish before.  (Without it the ranks launch together -- dpnb's collective
        # check lets a collective start once every rank has reached it -- and a 7 kB
        # all-reduce could finish before the hook returned: a correct hook was once
        # graded as waiting, in a full test run on 2 busy cores.)
        pending.append(not fut.done())
        return fut

    # the first c10d call a process makes under a dispatch mode (Counting is one)
    # costs about a second (measured: 1.2 s, then 1 ms): paid here, uncounted, so
    # that the learner's launch inside the hook returns at once, well inside HOOK_LATE_S
    with Counting(rank, world):
        dist.all_reduce(torch.zeros(1, device=dev))
    model = _net(d_in, d_hid, d_out).to(dev)
    ddp = DDP(model, bucket_cap_mb=cap_mb)  # its first broadcast is DDP's, not counted
    ddp.register_comm_hook(None, spy)
    x = _randn((8, d_in), 2000 + rank).to(dev)
    mode.launch_delay_s = HOOK_LATE_S if world > 1 and rank == world - 1 else 0.0
    try:
        with mode:
            ddp(x).pow(2).sum().backward()
    finally:
        mode.launch_delay_s = 0.0
    refs = []
    for r in range(world):
        m = _net(d_in, d_hid, d_out)
        m(_randn((8, d_in), 2000 + r)).pow(2).sum().backward()
        refs.append(_grads(m))
    got = _grads(model).cpu()
    return {"values": compare(got, torch.stack(refs).mean(0)), "kinds": kinds, "pending": pending,
            "tensor_bytes": tensor_bytes(got)}


def _zero(fn, ex: Exercise, case, rank: int, world: int, dev, mode: Counting, ns: dict) -> dict:
    """Three steps of ``fn``; then the bytes of every storage created during
    them that the learner still reaches (state, a global, a closure, an
    attribute: :func:`dpnb.engine.gradecount.kept_storages`), the grader's own
    tensors left out -- for ZeRO-2 a ``.grad`` left on a param counts (it is
    DDP's gradient memory, not 1/N of it)."""
    zero2 = ex.kind == "zero2_step"
    shapes = [tuple(s) for s in case]
    before = set(alive_storages())
    ref = [_randn(s, 3000 + i) for i, s in enumerate(shapes)]
    params = [p.clone().to(dev) for p in ref]  # copies: updated in place by the learner
    bufs: list | None = None
    state: dict = {}
    grads: list = []
    for step in range(ZERO1_STEPS):
        grads = [[_randn(s, 4000 + 100 * step + 10 * i + r) for i, s in enumerate(shapes)]
                 for r in range(world)]
        for p, g in zip(params, grads[rank]):
            p.grad = g.clone().to(dev)
        with mode:
            fn(params, state, ZERO1_LR, ZERO1_MOMENTUM)
        avg = [sum(grads[r][i] for r in range(world)) / world for i in range(len(shapes))]
        bufs = avg if bufs is None else [ZERO1_MOMENTUM * b + a for b, a in zip(bufs, avg)]
        ref = [p - ZERO1_LR * b for p, b in zip(ref, bufs)]
        del avg
    own = storages_of(ref, params, bufs, grads)
    if not zero2:  # ZeRO-1 keeps DDP's gradients: a .grad left is not the learner's state
        own |= storages_of([p.grad for p in params if p.grad is not None])
    kept = kept_storages(ns, state)
    if zero2:  # a .grad left on a param: DDP's gradient memory, kept by the grader's params
        kept.update(storages(p.grad for p in params if p.grad is not None))
    held = sum(b for ptr, b in kept.items() if ptr not in before and ptr not in own)
    got = torch.cat([p.detach().flatten() for p in params]).cpu()
    return {"values": compare(got, torch.cat([p.flatten() for p in ref])),
            "held": held, "tensor_bytes": tensor_bytes(got)}


RUNNERS = {"tensor": _tensor, "ddp_hook": _hook, "zero1_step": _zero, "zero2_step": _zero}


def run_case(ns: dict, ex: Exercise | str, name: str, index: int) -> dict:
    """Run case ``index`` of exercise ``ex`` (or a built-in exercise's key)
    against ``ns[name]`` on this rank, checked and counted; what it measured
    (a dict of builtins)."""
    if isinstance(ex, str):
        ex = exercise(ex)
    fn = ns[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = get_state(ns).comm_device  # the device the group's collectives take (CPU under gloo)
    mode = Counting(rank, world)
    with checked(ns):
        out = RUNNERS[ex.kind](fn, ex, ex.cases[index], rank, world, dev, mode, ns)
    out["ops"] = {k: list(v) for k, v in mode.counts.items()}
    out["rank"] = rank
    return out
