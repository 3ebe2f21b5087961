"""The ranks' side of ``%dp grade``: run the learner's function on one case, measure.

The notebook calls :func:`run_case` on every rank at once
(:mod:`dpnb.session.grading`), one case per call.  Each rank builds its own
input from a seed that names the rank, so every rank can also compute the
reference for *all* ranks locally (no communication is trusted to check
communication), calls the function the learner defined under ``name`` in the
engine's namespace, and reports: how far its result is from the reference,
each ``torch.distributed`` function it called with the bytes of the buffer
it was given (sends count what left this rank; the notebook costs
collectives as rings, :func:`dpnb.core.grading.sent_bytes`), and for ZeRO-1
the bytes of the optimizer state it kept.

While a case runs, the cell guard checks its calls as in a ``%%dp`` cell
(:mod:`dpnb.engine.cell.cellguard`): a send / recv pair of different sizes is a
:class:`~dpnb.engine.cell.p2pcheck.PointToPointMismatchError` on both ranks, not
gloo's abort.  A deadlock or an endless loop is the notebook's call timeout:
the ranks are interrupted and their group released
(:mod:`dpnb.cluster.waiting`), as a ``%%dp --timeout`` cell is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from dpnb.core.grading import RTOL, ZERO1_LR, ZERO1_MOMENTUM, ZERO1_STEPS, exercise
from dpnb.engine.state import get_state


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _list_bytes(ts) -> int:
    return sum(_nbytes(t) for t in ts or ())


#: the functions counted while a case runs -> the bytes of the full buffer they were given
FULL_BUFFER = {
    "send": lambda a: _nbytes(a.get("tensor")),
    "isend": lambda a: _nbytes(a.get("tensor")),
    "recv": lambda a: 0,
    "irecv": lambda a: 0,
    "all_reduce": lambda a: _nbytes(a.get("tensor")),
    "broadcast": lambda a: _nbytes(a.get("tensor")),
    "reduce": lambda a: _nbytes(a.get("tensor")),
    "all_gather": lambda a: _list_bytes(a.get("tensor_list")),
    "all_gather_into_tensor": lambda a: _nbytes(a.get("output_tensor")),
    "reduce_scatter": lambda a: _list_bytes(a.get("input_list")),
    "reduce_scatter_tensor": lambda a: _nbytes(a.get("input")),
    "all_gather_single": lambda a: _nbytes(a.get("output_tensor")),  # torch 2.13's names
    "reduce_scatter_single": lambda a: _nbytes(a.get("input")),
}


@contextlib.contextmanager
def counting():
    """Count every call of :data:`FULL_BUFFER`'s functions (any thread: a
    comm hook may run on autograd's) into ``{op: [calls, bytes]}``; the
    functions are restored after.  Set on both ``dist`` and ``c10d``, as
    the cell guard's wrappers are: ``P2POp`` compares ops by identity."""
    counts: dict[str, list[int]] = {}
    saved = []
    for name, size in FULL_BUFFER.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        sig = inspect.signature(fn)

        def counted(*args, __fn=fn, __name=name, __size=size, __sig=sig, **kwargs):
            try:
                nbytes = __size(__sig.bind_partial(*args, **kwargs).arguments)
            except TypeError:  # bad arguments: torch's own call below says so
                nbytes = 0
            c = counts.setdefault(__name, [0, 0])
            c[0] += 1
            c[1] += nbytes
            return __fn(*args, **kwargs)

        w = functools.wraps(fn)(counted)
        saved.append((name, fn, getattr(c10d, name, None)))
        dist.__dict__[name] = w
        if getattr(c10d, name, None) is fn:
            c10d.__dict__[name] = w
    try:
        yield counts
    finally:
        for name, fn, cfn in saved:
            dist.__dict__[name] = fn
            if cfn is not None:
                c10d.__dict__[name] = cfn


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


def _ring(fn, case, rank: int, world: int, dev) -> dict:
    (numel,) = case
    inputs = [_randn(numel, 1000 + r) for r in range(world)]
    t = inputs[rank].clone().to(dev)  # a copy: the reference below reads the inputs
    fn(t)
    return {"values": compare(t.cpu(), torch.stack(inputs).sum(0)), "tensor_bytes": _nbytes(t)}


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


def _hook(fn, case, rank: int, world: int, dev) -> dict:
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
        # stood still while the bucket was sent (no overlap)
        pending.append(not fut.done())
        return fut

    model = _net(d_in, d_hid, d_out).to(dev)
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(None, spy)
    ddp(_randn((8, d_in), 2000 + rank).to(dev)).pow(2).sum().backward()
    refs = []
    for r in range(world):
        m = _net(d_in, d_hid, d_out)
        m(_randn((8, d_in), 2000 + r)).pow(2).sum().backward()
        refs.append(_grads(m))
    got = _grads(model).cpu()
    return {"values": compare(got, torch.stack(refs).mean(0)), "kinds": kinds, "pending": pending,
            "tensor_bytes": _nbytes(got)}


def _held_bytes(state) -> int:
    """Bytes of the storages the tensors in ``state`` keep alive (a slice of a
    full-size tensor holds the full size), each storage once."""
    seen: dict[int, int] = {}
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return sum(seen.values())


def _zero1(fn, case, rank: int, world: int, dev, *, zero2: bool = False) -> dict:
    shapes = [tuple(s) for s in case]
    ref = [_randn(s, 3000 + i) for i, s in enumerate(shapes)]
    params = [p.clone().to(dev) for p in ref]  # copies: updated in place by the learner
    bufs: list | None = None
    state: dict = {}
    for step in range(ZERO1_STEPS):
        grads = [[_randn(s, 4000 + 100 * step + 10 * i + r) for i, s in enumerate(shapes)]
                 for r in range(world)]
        for p, g in zip(params, grads[rank]):
            p.grad = g.clone().to(dev)
        fn(params, state, ZERO1_LR, ZERO1_MOMENTUM)
        avg = [sum(grads[r][i] for r in range(world)) / world for i in range(len(shapes))]
        bufs = avg if bufs is None else [ZERO1_MOMENTUM * b + a for b, a in zip(bufs, avg)]
        ref = [p - ZERO1_LR * b for p, b in zip(ref, bufs)]
    got = torch.cat([p.detach().flatten() for p in params]).cpu()
    # ZeRO-2 also counts the gradients the learner left on the params: a full
    # .grad after the step is DDP's gradient memory, not 1/N of it
    left = [p.grad for p in params if p.grad is not None] if zero2 else []
    return {"values": compare(got, torch.cat([p.flatten() for p in ref])),
            "held": _held_bytes([state, left]), "tensor_bytes": _nbytes(got)}


def _zero2(fn, case, rank: int, world: int, dev) -> dict:
    return _zero1(fn, case, rank, world, dev, zero2=True)


RUNNERS = {"ring_allreduce": _ring, "allreduce_hook": _hook, "zero1_step": _zero1,
           "zero2_step": _zero2}


def run_case(ns: dict, key: str, name: str, index: int) -> dict:
    """Run case ``index`` of exercise ``key`` against ``ns[name]`` on this rank,
    checked and counted; what it measured (a dict of builtins)."""
    ex = exercise(key)
    fn = ns[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = get_state(ns).comm_device  # the device the group's collectives take (CPU under gloo)
    with checked(ns), counting() as ops:
        out = RUNNERS[key](fn, ex.cases[index], rank, world, dev)
    out["ops"] = {k: list(v) for k, v in ops.items()}
    out["rank"] = rank
    return out
