"""What a training session remembers between cells, as typed records.

The engines hold the model, the optimizer and the data position; the notebook
holds only what the next action needs to know about them: the last wrap (what
``restart --resume`` replays and ``%dp export`` writes), the last ``train``
call (the batch ``%dp resize`` keeps, the ``--step-fn`` a resume rebuilds),
the batch plan a resize left, the train calls since the wrap (the exported
job's schedule), where automatic checkpoints go, and the measured residency
per strategy (``%dp memory --during``).  Nothing here communicates.

:meth:`TrainingState.to_record` / :meth:`TrainingState.from_record` write and
read the same JSON keys a kept cluster's record has always had
(:mod:`dpnb.cluster.keep`), so a cluster kept by an older dpnb attaches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..core.events import TrainSummary
from ..core.trainargs import BatchArgs, TrainArgs
from .record import WrapStep


@dataclass(frozen=True)
class WrapRecord:
    """The last ``%dp wrap``: the step that made it -- the setup record holds the
    same step, so model, strategy and options are written once -- and rank 0's
    summary of the result."""

    step: WrapStep
    summary: dict | None = None

    @property
    def model(self) -> str:
        return self.step.model

    @property
    def strategy(self) -> str:
        return self.step.strategy

    @property
    def opts(self) -> dict:
        return self.step.opts

    def to_record(self) -> dict:
        return {"model": self.model, "strategy": self.strategy, **self.opts,
                "summary": self.summary}

    @classmethod
    def from_record(cls, d: dict) -> WrapRecord:
        rest = {k: v for k, v in d.items() if k not in ("model", "strategy", "summary")}
        return cls(WrapStep(d["model"], d.get("strategy", "ddp"), rest), summary=d.get("summary"))


@dataclass(frozen=True)
class LastTrain:
    """The last ``train`` call: its arguments, rank 0's summary, each rank's last progress."""

    args: TrainArgs
    summary: TrainSummary | None = None
    progress: dict = field(default_factory=dict)  # rank -> its last progress payload

    def to_record(self) -> dict:
        # the progress payloads describe a display, not the job: not kept
        return {**self.args.to_record(),
                "summary": None if self.summary is None else self.summary.to_record()}

    @classmethod
    def from_record(cls, d: dict) -> LastTrain:
        return cls(args=TrainArgs.from_record(d),
                   summary=TrainSummary.from_record(d.get("summary")))


@dataclass(frozen=True)
class BatchPlan:
    """The layout ``%dp resize`` chose so that the next ``train`` keeps the global batch."""

    micro_batch: int
    grad_accum: int
    global_batch: int

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, d: dict) -> BatchPlan:
        return cls(int(d["micro_batch"]), int(d["grad_accum"]), int(d["global_batch"]))


@dataclass(frozen=True, kw_only=True)
class TrainCall(BatchArgs):
    """One finished ``train`` call since the wrap: steps it ran, on how many ranks, how."""

    steps: int
    dp: int

    @classmethod
    def of(cls, steps: int, dp: int, args: TrainArgs) -> TrainCall:
        return cls(steps=int(steps), dp=dp, **{k: getattr(args, k) for k in EXPORTED_TRAIN_ARGS})

    def schedule_entry(self) -> dict:
        """What the exported job's ``SCHEDULE`` replays (the rank count is the job's own)."""
        return {k: v for k, v in asdict(self).items() if k != "dp" and v is not None}


#: the arguments of a train call that a batch job replays (dpnb.session.export)
EXPORTED_TRAIN_ARGS = tuple(f.name for f in fields(BatchArgs))


@dataclass
class TrainingState:
    """Everything the training session keeps about the job on the engines.

    Written by :mod:`dpnb.session.verbs` (wrap, train), :mod:`dpnb.session.resize` (the batch
    plan) and the residency view; read by resize, resume, export, keep/attach,
    the batch view and the dashboard.
    """

    last_wrap: WrapRecord | None = None
    last_train: LastTrain | None = None
    batch_plan: BatchPlan | None = None
    train_log: list[TrainCall] = field(default_factory=list)
    autosave_dir: str | None = None  # where %dp train --checkpoint-every writes
    peer_copy_every: int | None = None  # %dp train --peer-copy-every K, set on every rank each call
    residency: dict[str, Any] = field(default_factory=dict)  # strategy -> measured (not kept)
    residency_bytes: int | None = None  # the model size those were measured on

    @property
    def strategy(self) -> str:
        return self.last_wrap.strategy if self.last_wrap else "ddp"

    @property
    def steps_done(self) -> int:
        return sum(t.steps for t in self.train_log)

    def wrapped(self, rec: WrapRecord) -> None:
        """A new model: its training starts here."""
        self.last_wrap = rec
        self.train_log = []

    def loaded(self) -> None:
        """A checkpoint loaded (:class:`~dpnb.session.record.LoadStep`): the train
        calls before it no longer lead to the state, so the log starts again."""
        self.train_log = []

    def to_record(self) -> dict:
        """The keys a kept cluster's record carries for the session (JSON)."""
        return {
            "train_log": [t.to_record() for t in self.train_log],
            "last_wrap": self.last_wrap.to_record() if self.last_wrap else None,
            "batch_plan": self.batch_plan.to_record() if self.batch_plan else None,
            "last_train": self.last_train.to_record() if self.last_train else None,
            "autosave_dir": self.autosave_dir,
            # the interval every rank copies at: after %dp attach the session sets it
            # on a replaced rank too (one rank at the default while the others copy
            # at K would enter the copies' exchange alone); absent when never given
            **({"peer_copy_every": self.peer_copy_every} if self.peer_copy_every is not None
               else {}),
        }

    @classmethod
    def from_record(cls, rec: dict) -> TrainingState:
        """Read :meth:`to_record`'s keys (absent ones, as older records lack some, stay empty)."""
        w, t, b = rec.get("last_wrap"), rec.get("last_train"), rec.get("batch_plan")
        return cls(last_wrap=WrapRecord.from_record(w) if w else None,
                   last_train=LastTrain.from_record(t) if t else None,
                   batch_plan=BatchPlan.from_record(b) if b else None,
                   train_log=[TrainCall.from_record(x) for x in rec.get("train_log") or []],
                   autosave_dir=rec.get("autosave_dir"),
                   peer_copy_every=rec.get("peer_copy_every"))
