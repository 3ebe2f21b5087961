"""Training progress as one typed event, encoded on a rank and decoded once on the notebook.

While ``train`` runs the engines are busy, so progress travels the one way
that needs no reply: rank 0 publishes a small payload through ipyparallel's
data channel (``datapub``) at most ~5 times a second, and the notebook's
client keeps the latest one in its metadata (on its I/O thread).  The engine
builds a :class:`ProgressEvent` and sends :meth:`ProgressEvent.encode`; the
notebook side turns whatever the metadata holds back into an event with
:meth:`ProgressEvent.decode` -- the only two places the wire key is spelled --
and the session hands events to its subscribers (the live progress view,
the dashboard, JupyterLab's sidebar).  :meth:`ProgressEvent.as_dict` is the
plain payload views render.  Pure: no torch, no IPython.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .indexed import Indexed

#: the datapub key the payload travels under
WIRE_KEY = "dpnb_progress"


@dataclass(frozen=True)
class ProgressEvent:
    """One rank's progress in a ``train`` call: the step it finished and the numbers
    every rank agrees on (global loss, every rank's compute time); ``history``
    carries the recent ``(step, loss, samples/s)`` so a reader polling less often
    than steps finish still draws every step."""

    rank: int
    step: int | None = None
    done: int | None = None
    total: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    compute_s_all: Any = None
    history: Any = None

    def as_dict(self) -> dict:
        """The payload as plain values, the keys views and JupyterLab read (a value
        not known is left out, as a payload that never carried it)."""
        return {k: getattr(self, k) for k in _NAMES if getattr(self, k) is not None}

    def encode(self) -> dict:
        """What the rank publishes (``ipyparallel.datapub.publish_data``): every
        key, a value not known as None (readers of the wire see one shape)."""
        return {WIRE_KEY: {k: getattr(self, k) for k in _NAMES}}

    @classmethod
    def decode(cls, data: Any) -> ProgressEvent | None:
        """The event in a datapub message's ``data`` (or None: no progress, or another
        payload).  Keys an older or newer dpnb adds or lacks are left out or default."""
        p = data.get(WIRE_KEY) if isinstance(data, dict) else None
        if not isinstance(p, dict) or "rank" not in p:
            return None
        return cls(**{k: p[k] for k in _NAMES if k in p})


_NAMES = tuple(f.name for f in fields(ProgressEvent))


@dataclass(frozen=True)
class TrainSummary(Indexed):
    """What one ``train`` call returns from every rank (the notebook keeps rank 0's):
    the numbers every rank agrees on (the loss is the global mean, gathered every
    step), the steps run and why they stopped, the batch layout, the throughput
    and the checkpoints written.  Built by :func:`dpnb.engine.train.call.train`;
    indexable as the dict it once was (``s["loss"]``)."""

    rank: int = 0
    strategy: str = "ddp"
    steps: int = 0
    requested_steps: int = 0
    first_step: int = 0
    last_step: int | None = None
    interrupted: bool = False
    stop_reason: str | None = None
    loss: float | None = None
    losses: list = field(default_factory=list)
    global_batch: int = 0
    micro_batch: int = 0
    grad_accum: int = 1
    dp: int = 1
    lr: float | None = None
    lr_scale: str = "none"
    steps_per_epoch: int | None = None
    epoch: int = 0
    time_s: float = 0.0
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    data_note: str | None = None
    checkpoints: list = field(default_factory=list)
    checkpoint_dir: str | None = None

    def progress_event(self) -> ProgressEvent:
        """The call's end as a progress event: the one place the summary's
        names (``last_step``, ``steps``, ``requested_steps``) meet progress's
        (``step``, ``done``, ``total``); the step time is the call's mean."""
        return ProgressEvent(rank=self.rank, step=self.last_step, done=self.steps,
                             total=self.requested_steps, loss=self.loss,
                             samples_per_s=self.samples_per_s, tokens_per_s=self.tokens_per_s,
                             step_time_s=self.time_s / self.steps if self.steps else None)

    def to_record(self) -> dict:
        return self.to_dict()

    @classmethod
    def from_record(cls, d: dict | None) -> TrainSummary | None:
        """Known keys only (a record from an older or newer dpnb); None stays None."""
        if d is None:
            return None
        names = set(cls._names())
        return cls(**{k: v for k, v in d.items() if k in names})
