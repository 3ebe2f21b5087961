"""Measurements the views draw: model-state bytes per rank, DDP buckets.

Two kinds of measurement live here, both taken on each rank about that rank
only (no collective is issued by anything in this module except the DDP
all-reduce that the comm hook itself launches on DDP's behalf):

* :func:`state_bytes` counts the bytes a rank *holds* for parameters,
  gradients and optimizer state by walking the actual tensors.  Each storage
  is counted once (DDP's ``gradient_as_bucket_view`` gradients are views into
  bucket buffers; FSDP2's sharded gradients of one group are views into one
  reduce-scatter output), a DTensor counts only its local shard, and a
  ``ZeroRedundancyOptimizer`` counts only the inner optimizer's state, which
  holds the parameters this rank owns.  So the numbers are what the rank's
  memory really holds, padding included.

* :class:`BucketRecorder` records, per training step, each DDP gradient
  bucket (index, parameters, bytes, when its all-reduce started and finished)
  and when backward computed each parameter's gradient.  The timeline it
  yields shows the overlap DDP exists for: the all-reduce of the last layers'
  bucket starts while backward is still computing the first layers.  Times are
  seconds relative to the step start (the step record's ``t_start``): host
  wall clock on CPU, CUDA events on GPU (host clocks would only tell when kernels were *queued*).
  When recording is off the hook is the plain averaging all-reduce that DDP's
  default hook does, plus one attribute check.  (Measured on 2 CPU ranks with
  a 4-block TinyLM and 13 buckets, recording adds about 5% to a 30 ms step,
  which is why ``train`` records by default only sampled steps --
  :func:`dpnb.engine.train.train_state.records_buckets` -- switching the recorder
  per step.)
  FSDP2 has no bucket hook -- it all-gathers and reduce-scatters per unit --
  so zero2/zero3 steps have no bucket records; ``dpnb.engine.metrics.views.watch``
  times FSDP's collectives.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from dpnb.engine import device as accel
from dpnb.engine.train.commhook import CommHook

__all__ = ["state_bytes", "BucketRecorder", "local_tensor"]

from dpnb.compat import local_tensor  # noqa: E402  (one copy; re-exported)


class _StorageCounter:
    """Adds up storage bytes, each underlying storage once."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = 0
        self.tensors = 0

    def add(self, t: torch.Tensor | None) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        t = local_tensor(t)
        if t.device.type == "meta":
            return 0
        st = t.untyped_storage()
        n = st.nbytes()
        key = (t.device.type, t.device.index, st.data_ptr())
        self.tensors += 1
        if n == 0 or key in self.seen:
            return 0
        self.seen.add(key)
        self.bytes += n
        return n


def state_bytes(module: torch.nn.Module, optimizer: Any, device: Any = None) -> dict:
    """Bytes this rank holds for ``module``'s parameters, gradients and
    ``optimizer``'s state, counted from the tensors (see module docstring).

    Returns builtins only: ``params``, ``grads``, ``optimizer``, ``total``,
    ``optimizer_by_key`` (e.g. ``{"exp_avg": ..., "step": ...}``), the element
    counts of the local parameter tensors, and ``peak_allocated`` /
    ``allocated`` where the device reports them (an accelerator), else ``None``.
    """
    pc, gc, oc = _StorageCounter(), _StorageCounter(), _StorageCounter()
    params = list(module.parameters())
    numel = 0
    for p in params:
        pc.add(p)
        numel += local_tensor(p).numel()
    for p in params:
        gc.add(p.grad)
    by_key: dict[str, int] = {}
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer
    if inner is not None:
        for pstate in inner.state.values():
            for k, v in pstate.items():
                if isinstance(v, torch.Tensor):
                    by_key[k] = by_key.get(k, 0) + oc.add(v)
    out = {
        "params": pc.bytes,
        "grads": gc.bytes,
        "optimizer": oc.bytes,
        "total": pc.bytes + gc.bytes + oc.bytes,
        "optimizer_by_key": by_key,
        "params_numel_local": numel,
        "n_params": len(params),
        "peak_allocated": None,
        "allocated": None,
    }
    dev = torch.device(device) if device is not None else None
    if dev is not None and accel.is_accel(dev):
        out["peak_allocated"] = accel.max_memory_allocated(dev)
        out["allocated"] = accel.memory_allocated(dev)
    return out


# --------------------------------------------------------------------------
# DDP bucket / backward timeline


class _Clock:
    """Timestamps relative to a step start: host wall clock (``time.time``,
    the clock of the step records' ``t_start``) on CPU, device events on an
    accelerator (resolved once the step's work has finished)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.cuda = accel.is_accel(dev)  # "events, not host time" (any accelerator)
        self.t0: Any = None

    def start(self, origin: float | None = None):
        if self.cuda:
            self.t0 = accel.timing_event(self.dev)
        else:
            self.t0 = time.time() if origin is None else origin

    def now(self):
        if self.cuda:
            return accel.timing_event(self.dev)
        return time.time() - self.t0

    def resolve(self, stamp) -> float | None:
        if stamp is None:
            return None
        if isinstance(stamp, float):
            return stamp
        stamp.synchronize()
        return self.t0.elapsed_time(stamp) / 1000.0


def _recording_allreduce_hook(rec, bucket):  # no annotations: DDP checks them literally
    """DDP comm hook: average the bucket -- with DDP's own all-reduce, or
    compressed (:class:`dpnb.engine.train.commhook.CommHook`) -- and, when
    recording, note when it was launched, when it completed (in the future's
    callback, which runs when the collective is done) and the bytes sent."""
    buf = bucket.buffer()
    entry = None
    if rec.enabled and rec._step is not None:
        # Recorded whenever a step is being recorded, not only in the synced
        # backward: an all-reduce in a no_sync micro-batch would be a bug and
        # should show up.
        entry = {
            "index": bucket.index(),
            "micro_batch": rec.micro,
            "numel": buf.numel(),
            "bytes": buf.numel() * buf.element_size(),
            "params": [rec.names.get(id(p), "?") for p in bucket.parameters()],
            "start": rec.clock.now(),
            "end": None,
        }
        rec.current_buckets.append(entry)
    fut, sent = rec.hook.send(bucket)
    if entry is None:  # not recording this step: no second callback per bucket
        return fut
    entry["sent_bytes"] = sent

    def _done(f):
        entry["end"] = rec.clock.now()
        return f.value()

    return fut.then(_done)


class BucketRecorder:
    """Per-step DDP bucket and backward-compute timeline for one rank.

    ``attach(ddp)`` registers the comm hook (DDP allows this once, before the
    first backward, which is why it is always registered and switched with
    :attr:`enabled`).  The training loop calls :meth:`begin_step` at the start
    of a step, :meth:`arm` right before the backward that synchronizes
    gradients (the last micro-batch), :meth:`disarm` after it, and
    :meth:`end_step` once the step's collectives are done; it sets
    :attr:`micro` to the micro-batch index before each backward.  Gradient-ready
    times come from ``register_post_accumulate_grad_hook`` on each parameter,
    registered only while recording is enabled.
    """

    def __init__(self, module: torch.nn.Module, device: Any, keep: int = 64):
        self.hook = CommHook("none")  # how buckets are sent; the wrap may set another
        self.device = torch.device(device)
        self.clock = _Clock(self.device)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.enabled = False
        self.armed = False
        self.steps: deque = deque(maxlen=keep)
        self.current_buckets: list = []
        self.current_ready: list = []
        self._bw_start = None
        self._bw_return = None
        self._step = None
        self.micro = 0  # micro-batch index within the step, set by the loop
        self._handles: list = []

    def attach(self, ddp) -> None:
        ddp.register_comm_hook(state=self, hook=_recording_allreduce_hook)

    def set_enabled(self, on: bool) -> None:
        on = bool(on)
        if on and not self._handles:
            for name, p in self._params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready_hook(name)))
        elif not on:
            for h in self._handles:
                h.remove()
            self._handles = []
        self.enabled = on

    def detach(self) -> None:
        self.set_enabled(False)

    def _ready_hook(self, name):
        def hook(_p):
            if self.armed:
                self.current_ready.append((name, self.clock.now()))

        return hook

    # -- step protocol ----------------------------------------------------
    def begin_step(self, step: int, origin: float | None = None) -> None:
        """Start recording step ``step``; on CPU ``origin`` (a ``time.time()``
        value, the step record's ``t_start``) is the zero of its timeline."""
        # DDP's first iteration runs with its construction-time buckets (one
        # per dtype); it rebuilds them in gradient-ready order in the next
        # forward.  Counted even when recording is off.
        self.iterations = getattr(self, "iterations", 0) + 1
        if not self.enabled:
            return
        self._step = step
        self.current_buckets = []
        self.current_ready = []
        self._bw_start = self._bw_return = None
        self.clock.start(origin)

    def arm(self) -> None:
        if self.enabled:
            self._bw_start = self.clock.now()
            self.armed = True

    def disarm(self) -> None:
        if self.enabled and self.armed:
            self._bw_return = self.clock.now()
        self.armed = False

    def end_step(self) -> None:
        if not self.enabled or self._step is None:
            return
        r = self.clock.resolve
        ready = [(n, r(t)) for n, t in self.current_ready]
        ready.sort(key=lambda x: x[1])
        buckets = []
        for b in self.current_buckets:
            b = dict(b, start=r(b["start"]), end=r(b["end"]))
            buckets.append(b)
        bw_start = r(self._bw_start)
        # Backward compute is a sequence of segments that each end when a
        # module's gradients land; consecutive parameters of one module are
        # merged into one segment.
        intervals = []
        prev = bw_start
        for name, t in ready:
            mod = name.rsplit(".", 1)[0] if "." in name else name
            if intervals and intervals[-1]["module"] == mod:
                intervals[-1]["end"] = t
                intervals[-1]["params"].append(name)
            else:
                intervals.append({"module": mod, "start": prev, "end": t, "params": [name]})
            prev = t
        self.steps.append(
            {
                "step": self._step,
                "initial_buckets": self.iterations == 1,
                "clock": "cuda_event" if self.clock.cuda else "time",
                "buckets": buckets,
                "backward": {
                    "start": bw_start,
                    "compute_end": ready[-1][1] if ready else None,
                    "returned": r(self._bw_return),
                    "intervals": intervals,
                },
            }
        )
        self._step = None
        self.current_buckets, self.current_ready = [], []
