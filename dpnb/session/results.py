"""What ``c.train``, ``c.resize`` and ``c.export`` return: typed, frozen results.

Each verb's answer is built once, on the notebook side, from what the ranks
sent back (rank 0's train summary, the world change, the checkpoint written);
nothing here communicates.  Fields are read as attributes (``s.loss``,
``up.added``); ``s["loss"]`` and ``s.get("loss")`` keep working, as these
were dicts before and notebooks index them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


class _Indexed:
    """``r["name"]`` / ``r.get("name")`` / ``"name" in r`` over a frozen dataclass's fields."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._names() else default

    def __contains__(self, key: object) -> bool:
        return key in self._names()

    def keys(self) -> list[str]:
        return list(self._names())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class TrainResult(_Indexed):
    """One ``train`` call, as rank 0 summed it up (every rank agrees on these numbers:
    the loss is the global mean, gathered every step), plus the notebook's batch note."""

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
    batch_note: str = ""  # the layout came from %dp resize's plan

    @classmethod
    def of(cls, summary: dict, batch_note: str = "") -> TrainResult:
        """From rank 0's summary (:func:`dpnb.engine.step.train`); keys it lacks keep defaults."""
        names = set(cls._names())
        return cls(**{k: v for k, v in summary.items() if k in names}, batch_note=batch_note)


@dataclass(frozen=True)
class ResizeResult(_Indexed):
    """One ``resize``: the sentence, the step carried, the batch plan, the hand-over
    checkpoint, the learning rate set (``keep="lr"``), the ranks before and after."""

    summary: str
    step: int | None
    plan: Any  # dpnb.core.resize.ResizePlan
    checkpoint: str
    lr: float | None
    old: int
    new: int
    added: list
    removed: list


@dataclass(frozen=True)
class ExportResult(_Indexed):
    """One ``export``: the folder, its files, the checkpoint and its step, what was left
    out and why, the command that runs the job."""

    dir: str
    files: list
    checkpoint: str
    step: int | None
    skipped: list
    command: str
