"""Engine-side helpers for the views in :mod:`dpnb.widgets`.

Every function takes the engine's user namespace ``ns`` first and is called
from the notebook by dotted name (``cluster.call("dpnb.engine.views.X",
...)``).  Return values are small dicts/lists of builtins.

Which ones communicate (and so must run on *every* rank at once, the default
``ranks=None`` of ``cluster.call``):

* :func:`bench_collective` / :func:`bench_allreduce` -- real all-reduce,
  reduce-scatter or all-gather over the default group, over a range of
  message sizes, with a barrier before each timed call so every rank starts
  together;
* :func:`ring_demo` -- ``reduce_scatter_tensor`` then
  ``all_gather_into_tensor`` on real tensors, and ``all_reduce`` of the same
  inputs to compare with.

The others are local to one rank and issue no collective:
:func:`set_straggle` (the training loop sleeps ``extras["straggle_delay_s"]``
in each step on that rank, so the others wait for it in the gradient sync),
:func:`watch` (timing hooks), :func:`gradsync_records`,
:func:`memory_snapshot`, :func:`live_summary`.

Timing conventions: times in seconds, relative to the start of the training
step; host wall clock on CPU (``time.time``, the clock of the training
records' ``t_start``), CUDA events on GPU (host clocks only tell when kernels
were queued).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from .state import get_state

__all__ = [
    "bench_collective",
    "bench_allreduce",
    "ring_demo",
    "set_straggle",
    "straggle_state",
    "watch",
    "unwatch",
    "gradsync_records",
    "memory_snapshot",
    "live_summary",
]

WATCH_KEY = "views_watch"
BENCH_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


class ViewError(RuntimeError):
    """A mistake the user can fix; the message says what to do."""


def _train_state(ns: dict):
    st = get_state(ns).extras.get("train")
    if st is None:
        raise ViewError(
            "no model is wrapped on this engine: run `%dp wrap MODEL --strategy ddp` "
            "and `%dp train` (with recording on) first"
        )
    return st


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------
# collective benchmark


def _comm_device(es) -> torch.device:
    return torch.device(es.device) if es.backend == "nccl" else torch.device("cpu")


def bench_collective(
    ns: dict,
    sizes: list,
    kind: str = "all_reduce",
    iters: int = 5,
    warmup: int = 1,
    dtype: str = "float32",
) -> dict:
    """Time ``kind`` on the default group for each message size (collective).

    Every rank must call this with the same arguments.  For each size S
    (bytes; rounded down to a whole number of elements divisible by the world
    size, at least one element per rank) it runs ``warmup`` untimed calls,
    then ``iters`` timed ones, each preceded by a barrier so the ranks start
    together.  S is the nccl-tests "size": the all-reduce buffer, the
    reduce-scatter *input*, the all-gather *output*.  Returns this rank's
    times; the notebook takes, per iteration, the slowest rank (a collective
    is done when the last rank is) and the median over iterations.
    """
    es = get_state(ns)
    if kind not in BENCH_KINDS:
        raise ViewError(f"unknown collective {kind!r}: choose one of {', '.join(BENCH_KINDS)}")
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ViewError(f"iters must be >= 1 and warmup >= 0, got iters={iters!r}, warmup={warmup!r}")
    if not dist.is_initialized():
        raise ViewError("torch.distributed is not initialized on this engine: start the cluster with dpnb.start()")
    dev = _comm_device(es)
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    n = es.world_size
    out_sizes: list[int] = []
    times: list[list[float]] = []
    for size in sizes:
        numel = max(n, (int(size) // item // n) * n)
        full = torch.ones(numel, dtype=dt, device=dev)
        shard = torch.ones(numel // n, dtype=dt, device=dev)

        def op() -> None:
            if kind == "all_reduce":
                dist.all_reduce(full)
            elif kind == "reduce_scatter":
                dist.reduce_scatter_tensor(shard, full)
            else:
                dist.all_gather_into_tensor(full, shard)

        for _ in range(warmup):
            op()
        _sync(dev)
        ts = []
        for _ in range(iters):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            op()
            _sync(dev)
            ts.append(time.perf_counter() - t0)
        out_sizes.append(numel * item)
        times.append(ts)
        del full, shard
    return {
        "rank": es.rank,
        "world_size": n,
        "backend": es.backend,
        "device": str(dev),
        "kind": kind,
        "dtype": dtype,
        "sizes": out_sizes,
        "times": times,
        "median_s": [statistics.median(t) for t in times],
    }


def bench_allreduce(ns: dict, sizes: list, iters: int = 5, warmup: int = 1) -> dict:
    """:func:`bench_collective` for ``all_reduce`` (collective: every rank)."""
    return bench_collective(ns, sizes, "all_reduce", iters, warmup)


# --------------------------------------------------------------------------
# ring all-reduce = reduce-scatter + all-gather, on real tensors


def ring_demo(ns: dict, numel: int | None = None, seed: int = 0) -> dict:
    """Reduce-scatter then all-gather real tensors and compare with all-reduce (collective).

    Each rank builds its own input x_r (integer-valued float32, seeded by
    ``seed`` and the rank, so sums are exact and the comparison can demand
    bit equality).  ``reduce_scatter_tensor`` leaves rank r with chunk r of
    Σ x (1/N of the buffer, (N−1)/N·S bytes sent per rank);
    ``all_gather_into_tensor`` sends every reduced chunk to every rank
    (another (N−1)/N·S); the result must equal ``all_reduce`` of the same
    inputs, which moves 2(N−1)/N·S per rank with a ring.
    """
    es = get_state(ns)
    n = es.world_size
    dev = _comm_device(es)
    if numel is None:
        numel = 2 * n
    numel = max(n, (int(numel) // n) * n)
    g = torch.Generator().manual_seed(int(seed) * 1000 + es.rank)
    x = torch.randint(-9, 10, (numel,), generator=g).to(torch.float32).to(dev)
    shard = torch.empty(numel // n, dtype=torch.float32, device=dev)
    gathered = torch.empty(numel, dtype=torch.float32, device=dev)
    ar = x.clone()
    dist.barrier()
    _sync(dev)
    t0 = time.perf_counter()
    dist.reduce_scatter_tensor(shard, x.clone())
    _sync(dev)
    t1 = time.perf_counter()
    dist.all_gather_into_tensor(gathered, shard)
    _sync(dev)
    t2 = time.perf_counter()
    dist.barrier()
    _sync(dev)
    t3 = time.perf_counter()
    dist.all_reduce(ar)
    _sync(dev)
    t4 = time.perf_counter()
    small = numel <= 64

    def lst(t: torch.Tensor) -> list:
        return [float(v) for v in t.cpu().tolist()] if small else [float(v) for v in t[:8].cpu().tolist()]

    return {
        "rank": es.rank,
        "world_size": n,
        "numel": numel,
        "bytes": numel * 4,
        "chunk_numel": numel // n,
        "shown_all": small,
        "input": lst(x),
        "shard": [float(v) for v in shard.cpu().tolist()] if small else lst(shard),
        "gathered": lst(gathered),
        "allreduce": lst(ar),
        "equal": bool(torch.equal(gathered, ar)),
        "max_abs_diff": float((gathered - ar).abs().max().item()),
        "reduce_scatter_s": t1 - t0,
        "all_gather_s": t2 - t1,
        "all_reduce_s": t4 - t3,
    }


# --------------------------------------------------------------------------
# stragglers


def set_straggle(ns: dict, delay_ms: float) -> dict:
    """Make this rank sleep ``delay_ms`` in every training step (0 clears it).

    Local: no communication.  The training loop reads
    ``extras["straggle_delay_s"]`` at each step and sleeps before the last
    micro-batch's forward, so the other ranks wait for this one in the
    gradient all-reduce: the slowest rank gates every step.
    """
    es = get_state(ns)
    d = float(delay_ms)
    if not d >= 0:
        raise ViewError(f"--delay must be >= 0 milliseconds, got {delay_ms!r}")
    es.extras["straggle_delay_s"] = d / 1000.0
    return {"rank": es.rank, "delay_s": d / 1000.0}


def straggle_state(ns: dict) -> dict:
    """This rank's injected delay (seconds)."""
    es = get_state(ns)
    return {"rank": es.rank, "delay_s": float(es.extras.get("straggle_delay_s") or 0.0)}


# --------------------------------------------------------------------------
# timing hooks: forward, optimizer step, FSDP all-gather / reduce-scatter


class _Watch:
    """Forward, optimizer-step and FSDP collective times of recent steps on one rank.

    Keyed by the training step index (``TrainState.step`` while the step
    runs).  Stamps are ``time.time()`` on CPU and CUDA events on GPU; they are
    made relative to the step start when fetched.
    """

    def __init__(self, st: Any, keep: int = 64):
        self.st = st
        self.device = torch.device(st.device)
        self.cuda = self.device.type == "cuda"
        self.keep = keep
        self.steps: OrderedDict = OrderedDict()
        self.handles: list = []
        self.opt_id = id(st.optimizer)
        self.fsdp_groups = 0

    def stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.time()

    def entry(self) -> dict:
        step = int(self.st.step)
        e = self.steps.get(step)
        if e is None:
            e = {"origin": None, "forward": [], "optimizer": None, "collectives": []}
            self.steps[step] = e
            while len(self.steps) > self.keep:
                self.steps.popitem(last=False)
        if self.cuda and e["origin"] is None:
            rec = getattr(self.st, "recorder", None)
            t0 = getattr(getattr(rec, "clock", None), "t0", None) if rec is not None and rec.enabled else None
            e["origin"] = t0 if isinstance(t0, torch.cuda.Event) else self.stamp()
        return e

    # hooks ------------------------------------------------------------------
    def fwd_pre(self, _m, _args):
        e = self.entry()
        e["forward"].append([self.stamp(), None])

    def fwd_post(self, _m, _args, _out):
        e = self.entry()
        if e["forward"] and e["forward"][-1][1] is None:
            e["forward"][-1][1] = self.stamp()

    def opt_pre(self, _opt, _args, _kwargs):
        self.entry()["optimizer"] = [self.stamp(), None]

    def opt_post(self, _opt, _args, _kwargs):
        e = self.entry()
        if e["optimizer"] is not None:
            e["optimizer"][1] = self.stamp()

    def begin(self, kind: str, nbytes: int, phase: str, unit: str) -> dict:
        ev = {"kind": kind, "bytes": int(nbytes), "phase": phase, "unit": unit,
              "start": self.stamp(), "end": None}
        self.entry()["collectives"].append(ev)
        return ev

    def end(self, ev: dict, work) -> None:
        if self.cuda or work is None:
            ev["end"] = self.stamp()
            return
        try:
            fut = work.get_future()

            def done(f, ev=ev):
                ev["end"] = time.time()
                return f.value()

            fut.then(done)
        except Exception:  # a backend without futures: time the launch only
            ev["end"] = self.stamp()

    # resolution -------------------------------------------------------------
    def resolve(self, stamp, origin_wall: float | None, origin) -> float | None:
        if stamp is None:
            return None
        if isinstance(stamp, float):
            return stamp - origin_wall if origin_wall is not None else None
        if origin is None:
            return None
        stamp.synchronize()
        return origin.elapsed_time(stamp) / 1000.0

    def step_view(self, step: int, t_start: float | None) -> dict | None:
        e = self.steps.get(step)
        if e is None:
            return None
        r = lambda s: self.resolve(s, t_start, e["origin"])  # noqa: E731
        opt = e["optimizer"]
        return {
            "forward": [{"start": r(a), "end": r(b)} for a, b in e["forward"]],
            "optimizer": None if opt is None else {"start": r(opt[0]), "end": r(opt[1])},
            "collectives": [
                dict(c, start=r(c["start"]), end=r(c["end"]) if c["end"] is not None else r(c["start"]))
                for c in e["collectives"]
            ],
        }


def _timed_comms(watch: _Watch, pg: Any):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    def phase() -> str:
        state = getattr(pg, "_training_state", None)
        name = getattr(state, "name", "")
        return "forward" if name == "FORWARD" else "backward"

    def unit() -> str:  # FSDP sets the name at lazy init, after watch() may have run
        return getattr(pg, "_module_fqn", None) or "(root)"

    class TimedAllGather(DefaultAllGather):
        """FSDP2's default all-gather, timed (a subclass, so FSDP treats it as the default)."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            ev = watch.begin("all_gather", output_tensor.numel() * output_tensor.element_size(), phase(), unit())
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            watch.end(ev, work)
            return work

    class TimedReduceScatter(DefaultReduceScatter):
        """FSDP2's default reduce-scatter, timed."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            ev = watch.begin("reduce_scatter", input_tensor.numel() * input_tensor.element_size(), "backward", unit())
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            watch.end(ev, work)
            return work

    return TimedAllGather(), TimedReduceScatter()


def watch(ns: dict) -> dict:
    """Install timing hooks for the gradsync view on this rank (no communication).

    Times each forward of the wrapped module, the optimizer step
    (``register_step_pre_hook``/``post_hook``) and, under FSDP2 (zero2/zero3),
    every all-gather and reduce-scatter FSDP issues (its default comm objects
    replaced by timed subclasses that do exactly the same call).  DDP bucket
    all-reduces are already timed by the training layer's comm hook.
    Idempotent; a new ``%dp wrap`` needs a new ``watch``.
    """
    es = get_state(ns)
    st = _train_state(ns)
    old = es.extras.get(WATCH_KEY)
    if old is not None and old.st is st and old.opt_id == id(st.optimizer):
        return {"rank": es.rank, "installed": False, "fsdp_groups": old.fsdp_groups}
    if old is not None:
        _remove(old)
    w = _Watch(st)
    w.handles.append(st.module.register_forward_pre_hook(w.fwd_pre, prepend=True))
    w.handles.append(st.module.register_forward_hook(w.fwd_post, always_call=True))
    w.handles.append(st.optimizer.register_step_pre_hook(w.opt_pre))
    w.handles.append(st.optimizer.register_step_post_hook(w.opt_post))
    if st.strategy in ("zero2", "zero3"):
        from torch.distributed.fsdp import FSDPModule

        for m in st.module.modules():
            if not isinstance(m, FSDPModule):
                continue
            for pg in getattr(m._get_fsdp_state(), "_fsdp_param_groups", []) or []:
                ag, rs = _timed_comms(w, pg)
                pg._all_gather_comm = ag
                pg._reduce_scatter_comm = rs
                w.fsdp_groups += 1
    es.extras[WATCH_KEY] = w
    return {"rank": es.rank, "installed": True, "fsdp_groups": w.fsdp_groups}


def _remove(w: _Watch) -> None:
    for h in w.handles:
        try:
            h.remove()
        except Exception:
            pass
    w.handles = []


def unwatch(ns: dict) -> dict:
    """Remove the hooks :func:`watch` installed (FSDP's timed comms stay: they behave like the defaults)."""
    es = get_state(ns)
    w = es.extras.pop(WATCH_KEY, None)
    if w is not None:
        _remove(w)
    return {"rank": es.rank, "removed": w is not None}


# --------------------------------------------------------------------------
# records for the gradsync view


def _param_bytes(st) -> dict:
    out = {}
    for name, p in st.module.named_parameters():
        if p.requires_grad:
            out[name] = int(p.numel() * p.element_size())
    return out


def gradsync_records(ns: dict, last: int = 1) -> list:
    """The last ``last`` recorded steps on this rank, in the gradsync view's format.

    Joins the training layer's per-step record (step time, compute time,
    straggle delay), its DDP bucket recorder (each bucket's all-reduce
    start/end, backward compute intervals per module) and, if :func:`watch`
    was installed before the step, forward/optimizer times and FSDP
    collectives.  Times are seconds from the step start.  Local, no
    communication.
    """
    es = get_state(ns)
    st = _train_state(ns)
    recs = {r["step"]: r for r in st.records}
    rec = st.recorder
    bsteps = {b["step"]: b for b in (rec.steps if rec is not None else [])}
    w = es.extras.get(WATCH_KEY)
    wsteps = w.steps if (w is not None and w.st is st) else {}
    candidates = sorted(s for s in recs if s in bsteps or s in wsteps)
    if not candidates:
        candidates = sorted(recs)
    picked = candidates[-int(last):] if last else candidates
    pbytes = _param_bytes(st)
    order = list(pbytes)
    out = []
    for s in picked:
        r = recs[s]
        b = bsteps.get(s)
        wv = w.step_view(s, r.get("t_start")) if (w is not None and s in wsteps) else None
        out.append({
            "rank": es.rank,
            "world_size": es.world_size,
            "step": s,
            "strategy": st.strategy,
            "bucket_cap_mb": st.config.get("bucket_cap_mb"),
            "device": str(st.device),
            "step_time_s": r.get("step_time_s"),
            "compute_s": r.get("compute_s"),
            "compute_s_all": r.get("compute_s_all"),
            "straggle_delay_s": r.get("straggle_delay_s", 0.0),
            "grad_accum": r.get("grad_accum", 1),
            "buckets": [dict(x) for x in b["buckets"]] if b else [],
            "initial_buckets": bool(b.get("initial_buckets")) if b else False,
            "backward": dict(b["backward"]) if b else None,
            "forward": wv["forward"] if wv else [],
            "optimizer": wv["optimizer"] if wv else None,
            "collectives": wv["collectives"] if wv else [],
            "watched": wv is not None,
            "param_bytes": pbytes,
            "param_order": order,
        })
    return out


# --------------------------------------------------------------------------
# memory


def _optimizer_name(st) -> str:
    name = st.config.get("optimizer", "adamw")
    if name == "sgd":
        return "sgd-momentum" if float(st.config.get("momentum") or 0.0) != 0.0 else "sgd"
    return name


def memory_snapshot(ns: dict) -> dict:
    """What this rank holds for model states, and what the exact model needs to predict it.

    ``measured``: the byte counts the training loop took right after the last
    recorded ``optimizer.step()`` (before ``zero_grad``, the moment
    :func:`dpnb.core.exact_rank_bytes` models), or, if no step was recorded,
    counted now with :func:`dpnb.engine.measure.state_bytes` (``phase`` says
    which; between steps the gradients have been freed).  ``specs``: name,
    global shape, dtype and trainable flag of every parameter (a DTensor
    reports its global shape).  Local, no communication.
    """
    from .measure import state_bytes

    es = get_state(ns)
    st = _train_state(ns)
    measured, phase, step = None, "now", None
    for r in reversed(st.records):
        if r.get("bytes"):
            measured, phase, step = r["bytes"], "after_step", r["step"]
            break
    if measured is None:
        measured = state_bytes(st.module, st.optimizer, st.device)
    specs = [[n, [int(d) for d in p.shape], str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
             for n, p in st.module.named_parameters()]
    return {
        "rank": es.rank,
        "world_size": es.world_size,
        "strategy": st.strategy,
        "optimizer": _optimizer_name(st),
        "mixed_precision": st.config.get("mixed_precision", "none"),
        "gradient_as_bucket_view": bool(st.ddp_kwargs.get("gradient_as_bucket_view", False)),
        "specs": specs,
        "n_params": int(sum(p.numel() for p in st.module.parameters())),
        "measured": {k: measured.get(k) for k in ("params", "grads", "optimizer", "total",
                                                    "peak_allocated", "allocated")},
        "phase": phase,
        "step": step,
    }


# --------------------------------------------------------------------------
# dashboard / live settings


def live_summary(ns: dict, history: int = 200) -> dict:
    """This rank's identity, wrap config, last step record and recent losses (local)."""
    es = get_state(ns)
    st = es.extras.get("train")
    out: dict = {"rank": es.rank, "world_size": es.world_size, "backend": es.backend,
                 "device": str(es.device), "wrapped": st is not None,
                 "straggle_delay_s": float(es.extras.get("straggle_delay_s") or 0.0)}
    if st is None:
        return out
    recs = list(st.records)
    out.update({
        "n_params": int(sum(p.numel() for p in st.module.parameters())),
        "grad_bytes": int(sum(p.numel() * p.element_size() for p in st.module.parameters() if p.requires_grad)),
        "strategy": st.strategy,
        "config": dict(st.config),
        "step": st.step,
        "last": dict(recs[-1]) if recs else None,
        "history": [[r["step"], r["loss"], r.get("samples_per_s")] for r in recs[-int(history):]],
    })
    return out
