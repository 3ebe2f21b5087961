"""Engine-side helpers for the views in :mod:`dpnb.widgets`.

Every function takes the engine's user namespace ``ns`` first and is called
from the notebook by dotted name (``cluster.call("dpnb.engine.metrics.views.X",
...)``).  Return values are small dicts/lists of builtins.

The collectives (:func:`bench_collective`, :func:`bench_allreduce`,
:func:`ring_demo`) live in :mod:`dpnb.engine.metrics.bench`, the timing hooks
(:func:`watch`, :func:`gradsync_records`) in :mod:`dpnb.engine.metrics.watch`; their
names are kept here for the notebook.  The rest is local to one rank:
:func:`set_straggle` (the training loop sleeps ``EngineState.straggle_delay_s``
in each step on that rank, so the others wait for it in the gradient sync),
:func:`memory_snapshot`, :func:`live_summary`.
"""

from __future__ import annotations

import itertools

from dpnb.core.incidents import SERIES_MAX_POINTS, thin_steps
from dpnb.engine.metrics.bench import BENCH_KINDS, bench_allreduce, bench_collective, ring_demo
from dpnb.engine.train.measure import state_bytes
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import ViewError, viewed_state
from dpnb.engine.metrics.watch import gradsync_records, unwatch, watch

__all__ = [
    "ViewError", "BENCH_KINDS",
    "bench_collective", "bench_allreduce", "ring_demo", "set_straggle", "straggle_state",
    "watch", "unwatch", "gradsync_records", "memory_snapshot", "live_summary", "step_views",
]


# --------------------------------------------------------------------------
# stragglers


def set_straggle(ns: dict, delay_ms: float) -> dict:
    """Make this rank sleep ``delay_ms`` in every training step (0 clears it).

    Local: no communication.  The training loop reads
    ``EngineState.straggle_delay_s`` at each step and sleeps before the last
    micro-batch's forward, so the other ranks wait for this one in the
    gradient all-reduce: the slowest rank gates every step.
    """
    es = get_state(ns)
    d = float(delay_ms)
    if not d >= 0:
        raise ViewError(f"--delay must be >= 0 milliseconds, got {delay_ms!r}")
    es.straggle_delay_s = d / 1000.0
    return {"rank": es.rank, "delay_s": d / 1000.0}


def straggle_state(ns: dict) -> dict:
    """This rank's injected delay (seconds)."""
    es = get_state(ns)
    return {"rank": es.rank, "delay_s": float(es.straggle_delay_s or 0.0)}


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
    counted now with :func:`dpnb.engine.train.measure.state_bytes` (``phase`` says
    which; between steps the gradients have been freed).  ``specs``: name,
    global shape, dtype and trainable flag of every parameter (a DTensor
    reports its global shape).  Local, no communication.
    """

    es = get_state(ns)
    st = viewed_state(ns)
    measured, phase, step = None, "now", None
    for r in reversed(st.records):
        if r.bytes:
            measured, phase, step = r.bytes, "after_step", r.step
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
    st = es.train
    out: dict = {"rank": es.rank, "world_size": es.world_size, "backend": es.backend,
                 "device": str(es.device), "wrapped": st is not None,
                 "straggle_delay_s": float(es.straggle_delay_s or 0.0)}
    if st is None:
        return out
    # the last ``history`` made dicts, not every step run (that grew with the steps)
    keep = int(history) if history else len(st.records)
    recs = [r.as_dict() for r in list(itertools.islice(reversed(st.records), keep))[::-1]]
    out.update({
        "n_params": int(sum(p.numel() for p in st.module.parameters())),
        "grad_bytes": int(sum(p.numel() * p.element_size() for p in st.module.parameters() if p.requires_grad)),
        "strategy": st.strategy,
        "config": dict(st.config),
        "step": st.step,
        "last": dict(recs[-1]) if recs else None,
        "history": [[r["step"], r["loss"], r.get("samples_per_s")] for r in recs],
    })
    return out


def step_series(ns: dict, max_points: int = SERIES_MAX_POINTS) -> list:
    """This rank's recorded steps as ``[step, t_end, loss, samples_per_s]`` rows,
    thinned evenly to at most ``max_points`` (the last step always kept): what
    ``%dp incidents`` draws beside the faults.  Local, no communication; empty
    when no model is wrapped."""
    st = get_state(ns).train
    if st is None:
        return []
    return [[r.step, r.t_end, r.loss, r.samples_per_s] for r in thin_steps(list(st.records), max_points)]


# --------------------------------------------------------------------------
# JupyterLab's panels


def step_views(ns: dict) -> dict:
    """The last recorded step's timing record and this rank's model-state bytes, in
    one answer: what the notebook publishes for JupyterLab's gradient-sync and
    memory panels after a train call (``dpnb.core.labviews``).  Local, no
    communication; empty when no model is wrapped or no step was recorded."""
    if get_state(ns).train is None:
        return {"gradsync": [], "memory": None}
    try:
        sync = gradsync_records(ns, 1)
    except ViewError:  # no step recorded (train --no-record): memory alone
        sync = []
    return {"gradsync": sync, "memory": memory_snapshot(ns)}
