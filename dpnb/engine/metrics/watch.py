"""Timing hooks for the gradient-sync view, and the per-step records it draws.

:func:`watch` installs, on one rank and without any communication, hooks that
time each forward of the wrapped module and the optimizer step, and under
FSDP2 (zero2/zero3) every all-gather and reduce-scatter FSDP issues (its
default comm objects replaced by timed subclasses that make exactly the same
call).  DDP bucket all-reduces are timed by the training layer's comm hook.
:func:`gradsync_records` joins all of it per step.

Timing conventions: seconds relative to the start of the training step; host
wall clock on CPU (``time.time``, the clock of the step records'
``t_start``), CUDA events on GPU (host clocks only tell when kernels were
queued).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from dpnb import compat
from dpnb.core.strategies import is_fsdp
from dpnb.engine import device
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import viewed_state

log = logging.getLogger(__name__)


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
        self.cuda = device.is_accel(self.device)  # events, not host time
        self.keep = keep
        self.steps: OrderedDict = OrderedDict()
        self.handles: list = []
        self.opt_id = id(st.optimizer)
        self.fsdp_groups = 0

    def stamp(self):
        if self.cuda:
            return device.timing_event(self.device)
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
            e["origin"] = t0 if device.is_event(t0) else self.stamp()
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
        except RuntimeError as e:  # a backend without futures: time the launch only
            log.debug("collective has no future (%s): its launch is timed", e)
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
    DefaultAllGather, DefaultReduceScatter = compat.fsdp_default_comms()

    def phase() -> str:
        return compat.fsdp_group_phase(pg)

    def unit() -> str:  # FSDP sets the name at lazy init, after watch() may have run
        return compat.fsdp_group_unit(pg)

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
    st = viewed_state(ns)
    old = es.watch
    if old is not None and old.st is st and old.opt_id == id(st.optimizer):
        return {"rank": es.rank, "installed": False, "fsdp_groups": old.fsdp_groups}
    if old is not None:
        _remove(old)
    w = _Watch(st)
    w.handles.append(st.module.register_forward_pre_hook(w.fwd_pre, prepend=True))
    w.handles.append(st.module.register_forward_hook(w.fwd_post, always_call=True))
    w.handles.append(st.optimizer.register_step_pre_hook(w.opt_pre))
    w.handles.append(st.optimizer.register_step_post_hook(w.opt_post))
    if is_fsdp(st.strategy):
        for pg in compat.fsdp_param_groups(st.module):
            compat.set_fsdp_comms(pg, *_timed_comms(w, pg))
            w.fsdp_groups += 1
    es.watch = w
    return {"rank": es.rank, "installed": True, "fsdp_groups": w.fsdp_groups}


def _remove(w: _Watch) -> None:
    for h in w.handles:
        h.remove()  # torch's RemovableHandle.remove is idempotent
    w.handles = []


def unwatch(ns: dict) -> dict:
    """Remove the hooks :func:`watch` installed (FSDP's timed comms stay: they behave like the defaults)."""
    es = get_state(ns)
    w, es.watch = es.watch, None
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
    st = viewed_state(ns)
    # by step, as records (each made a dict only once picked: after every train call the
    # notebook asks for the last one, and converting all of them grew with the steps run --
    # 115 ms a call after 2,400 steps, measured)
    recs = {r.step: r for r in st.records}
    rec = st.recorder
    bsteps = {b["step"]: b for b in (rec.steps if rec is not None else [])}
    w = es.watch
    wsteps = w.steps if (w is not None and w.st is st) else {}
    # DDP keeps bucket timelines for sampled steps only: a watched step between
    # them has no buckets, so it is not one to show while a recorded one exists
    candidates = sorted(s for s in recs if s in bsteps or (s in wsteps and not bsteps))
    if not candidates:
        candidates = sorted(recs)
    picked = candidates[-int(last):] if last else candidates
    pbytes = _param_bytes(st)
    order = list(pbytes)
    out = []
    for s in picked:
        r = recs[s].as_dict()
        b = bsteps.get(s)
        wv = w.step_view(s, r.get("t_start")) if (w is not None and s in wsteps) else None
        out.append({
            "rank": es.rank,
            "world_size": es.world_size,
            "step": s,
            "strategy": st.strategy,
            "bucket_cap_mb": st.config.get("bucket_cap_mb"),
            "comm_hook": st.config.get("comm_hook", "none"),
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

