"""Data-parallel training inside each engine: the stable names the notebook calls.

The notebook calls these by dotted name (``dpnb.engine.train.training.wrap``,
``.set_data``, ``.train``, ``.records``, ...) on every engine at once; this
module keeps those names stable while the work lives in rooms of its own:

* :mod:`~dpnb.engine.train.train_state` -- TrainState, DataState, StepRecord;
* :mod:`~dpnb.engine.train.wrap` -- DDP / ZeRO-1 / FSDP2 wrapping and re-binding;
* :mod:`~dpnb.engine.train.dataset` -- the sharded dataset;
* :mod:`~dpnb.engine.train.step` -- the training step loop;
* :mod:`~dpnb.engine.train.measure` -- byte counts and DDP bucket timelines.

Every function takes the engine's user namespace ``ns`` first and keeps what
it builds there under names the user can reach from ``%%dp`` cells (``model``,
``optimizer`` by default), plus the private state in ``ns["_dpnb"].train``.
Return values are small dicts of builtins: they travel back over ipyparallel.
"""

from __future__ import annotations

from dpnb.core.strategies import LR_SCALES, MIXED_PRECISION, OPTIMIZERS, STRATEGIES
from dpnb.engine.train.microbatch import default_loss
from dpnb.engine.train.dataset import set_data
from dpnb.engine.train.measure import state_bytes
from dpnb.engine.state import get_state
from dpnb.core.events import TrainSummary
from dpnb.core.trainargs import TrainArgs
from dpnb.engine.train import call
from dpnb.engine.train.train_state import (
    BYTES_EVERY,
    RECORD_EVERY,
    MAX_RECORDS,
    DataState,
    StepRecord,
    TrainError,
    TrainState,
    require_bound,
    train_state,
)
from dpnb.engine.train.wrap import fsdp_units, rebind, wrap

__all__ = [
    "TrainError", "TrainState", "DataState", "StepRecord", "STRATEGIES", "MIXED_PRECISION",
    "OPTIMIZERS", "LR_SCALES", "BYTES_EVERY", "RECORD_EVERY", "MAX_RECORDS", "wrap", "set_data", "train",
    "records", "clear_records", "set_recording", "rebind", "train_state", "require_bound",
    "fsdp_units", "default_loss", "measure_state_bytes", "bucket_records", "scale_lr",
]


def records(ns: dict, since_step: int | None = None, last: int | None = None) -> list:
    """Per-step records on this rank, as dicts of builtins (see :class:`StepRecord`)."""
    st = train_state(ns)
    out = [r for r in st.records if since_step is None or r.step >= since_step]
    if last is not None:
        out = out[-last:]
    return [r.as_dict() for r in out]


def clear_records(ns: dict) -> None:
    st = train_state(ns)
    st.records.clear()
    if st.recorder is not None:
        st.recorder.steps.clear()


def set_recording(ns: dict, on: bool) -> dict:
    """Default for ``train(record=None)``: byte counts and sampled bucket
    timelines (on), or neither (off).  The recorder's hooks are switched per
    step by ``train``; nothing is installed here."""
    st = train_state(ns)
    st.record_default = bool(on)
    return {"recording": st.record_default}


# --------------------------------------------------------------------------
# measurements (called by name from the notebook; local, no communication)


def measure_state_bytes(ns: dict) -> dict:
    """:func:`state_bytes` of the wrapped model and optimizer on this rank,
    counted now (between steps gradients are usually freed; the training
    loop's per-step records hold the counts taken right after
    ``optimizer.step()``).  Local, no communication."""
    st = train_state(ns)
    out = state_bytes(st.module, st.optimizer, st.device)
    out.update(rank=get_state(ns).rank, strategy=st.strategy, step=st.step)
    return out


def bucket_records(ns: dict, last: int | None = None) -> list:
    """Recorded DDP bucket/backward timelines of recent steps on this rank.

    One dict per recorded step: ``step``, ``clock``, ``buckets`` (``index``,
    ``params``, ``numel``, ``bytes``, ``start``, ``end`` of its all-reduce) and
    ``backward`` (``start``, ``compute_end`` = last gradient ready,
    ``returned`` = when ``backward()`` returned after DDP waited for its
    all-reduces, and per-module ``intervals``).  Seconds from the step start.
    Empty for FSDP strategies (FSDP2 has no bucket hook; its collectives
    are per unit) or when recording was off.  Local, no communication.
    """
    st = train_state(ns)
    rec = st.recorder
    if rec is None:
        return []
    steps = list(rec.steps)
    if last is not None:
        steps = steps[-int(last):]
    return [
        dict(s, buckets=[dict(b) for b in s["buckets"]], backward=dict(s["backward"]))
        for s in steps
    ]


def scale_lr(ns: dict, factor: float) -> dict:
    """Multiply every param group's learning rate by ``factor`` (``%dp resize
    --scale-lr``: the global batch changed with the number of ranks).  Local;
    every rank applies the same factor, so the replicas stay in step."""
    st = require_bound(ns)
    for g in st.optimizer.param_groups:
        g["lr"] = float(g["lr"]) * float(factor)
    return {"lr": float(st.optimizer.param_groups[0]["lr"])}


def train(ns: dict, args: TrainArgs | None = None, **kw) -> TrainSummary:
    """Run one ``train`` call on this rank (every rank at once: collective).

    ``args`` is the notebook's one :class:`~dpnb.core.trainargs.TrainArgs`;
    hand-written engine code and the exported job may give keywords instead
    (``train(ns, steps=5, micro_batch=8)``).  What it does, step by step:
    :func:`dpnb.engine.train.call.train`.
    """
    if args is not None and kw:
        raise TrainError("give train either a TrainArgs or keywords, not both")
    return call.train(ns, args if args is not None else TrainArgs.of(**kw))
