"""What ``c.train``, ``c.resize`` and ``c.export`` return: typed, frozen results.

Each verb's answer is built once, on the notebook side, from what the ranks
sent back (rank 0's train summary, the world change, the checkpoint written);
nothing here communicates.  Fields are read as attributes (``s.loss``,
``up.added``); ``s["loss"]`` and ``s.get("loss")`` keep working, as these
were dicts before and notebooks index them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.events import TrainSummary
from ..core.indexed import Indexed


@dataclass(frozen=True)
class TrainResult(TrainSummary):
    """One ``train`` call, as rank 0 summed it up (every rank agrees on these numbers:
    the loss is the global mean, gathered every step), plus the notebook's batch note."""

    batch_note: str = ""  # the layout came from %dp resize's plan

    @classmethod
    def of(cls, summary: TrainSummary, batch_note: str = "") -> TrainResult:
        """From rank 0's summary (:func:`dpnb.engine.train.call.train`) and the notebook's note."""
        return cls(**asdict(summary), batch_note=batch_note)


@dataclass(frozen=True)
class ResizeResult(Indexed):
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
class ExportResult(Indexed):
    """One ``export``: the folder, its files, the checkpoint and its step, what was left
    out and why, the command that runs the job."""

    dir: str
    files: list
    checkpoint: str
    step: int | None
    skipped: list
    command: str
