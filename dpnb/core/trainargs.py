"""One ``train`` call's arguments: the contract across the rank boundary.

Built once -- by ``%dp train``'s parser, by ``Cluster.train(**kw)``, by an
exported job's schedule, or by hand-written engine code (``training.train(ns,
steps=...)``) -- checked once on the notebook (:meth:`TrainArgs.checked`),
and sent as this one object to every rank (``cluster.call(ep.TRAIN, args)``),
where :func:`dpnb.engine.train.trainplan.plan` checks it again against the
data and the world size before anything changes.  A batch job replays its
:class:`BatchArgs`.  Pure: no torch, no IPython.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace

from .errors import ConfigError
from .peerplan import parse_every
from .strategies import LR_SCALES
from .traincounts import count_problem

#: a field only the notebook reads (how long it waits, what it sets before the call)
NOTEBOOK_ONLY = {"notebook": True}


@dataclass(frozen=True, kw_only=True)
class BatchArgs:
    """How a train call batches and steps: what an exported job replays."""

    micro_batch: int | None = None
    grad_accum: int | None = None
    lr_scale: str = "none"
    ref_batch: int | None = None
    seq_len: int | None = None
    step_fn: str | None = None
    loss_fn: str | None = None

    def to_record(self) -> dict:
        """The JSON a kept cluster's record holds (the notebook-only fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.metadata.get("notebook")}

    @classmethod
    def from_record(cls, d: dict):
        """Known keys only: a record may carry others (a summary) or lack some (older)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class TrainArgs(BatchArgs):
    """One ``train`` call's arguments.

    ``steps`` / ``epochs``: how long; ``record``: keep bucket timelines (None:
    sampled); ``publish``: rank 0 publishes progress (``progress=False`` in
    ``Cluster.train`` turns it off); ``checkpoint_every`` / ``checkpoint_dir``:
    automatic checkpoints.  ``timeout`` (how long the notebook waits) and
    ``peer_copy_every`` (set on every rank before the call) are the notebook's;
    the ranks ignore them and a kept record leaves them out.
    """

    steps: int | None = None
    epochs: int | None = None
    record: bool | None = None
    publish: bool = True
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    timeout: float | None = field(default=None, metadata=NOTEBOOK_ONLY)
    peer_copy_every: int | None = field(default=None, metadata=NOTEBOOK_ONLY)

    @classmethod
    def of(cls, **kw) -> TrainArgs:
        """From the keywords a user writes (``progress=False`` is ``publish=False``);
        an unknown keyword is refused in one line."""
        if "progress" in kw:
            kw["publish"] = bool(kw.pop("progress"))
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ConfigError(f"train takes no {', '.join(unknown)}: its options are "
                              f"{', '.join(sorted(names - {'publish'}) + ['progress'])}")
        return cls(**kw)

    @classmethod
    def checked(cls, **kw) -> TrainArgs:
        """The call's arguments, refused in one line when bad, before anything is sent.

        The counts by the rule every rank applies again (:mod:`dpnb.core.traincounts`);
        ``checkpoint_dir`` made absolute (the ranks may run elsewhere)."""
        a = cls.of(**kw)
        if a.steps is None and a.epochs is None:
            raise ConfigError("say how long to train: --steps S or --epochs E")
        problem = count_problem(steps=a.steps, epochs=a.epochs, micro_batch=a.micro_batch,
                                grad_accum=a.grad_accum)  # the engine's own rule (trainplan)
        if problem:
            raise ConfigError(problem)
        if a.lr_scale not in LR_SCALES:
            raise ConfigError(f"--lr-scale must be one of {', '.join(LR_SCALES)} "
                              f"(got {a.lr_scale!r})")
        k = a.checkpoint_every
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"--checkpoint-every must be a whole number of steps >= 1 "
                              f"(got {k!r})")
        if a.peer_copy_every is not None:
            a = replace(a, peer_copy_every=parse_every(a.peer_copy_every))
        if a.checkpoint_dir is None:
            return a
        return replace(a, checkpoint_dir=os.path.abspath(os.path.expanduser(a.checkpoint_dir)))

    def as_dict(self) -> dict:
        return asdict(self)
