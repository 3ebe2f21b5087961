"""What built the ranks' state, as typed steps: the session's setup record.

``restart --resume`` replays it on rebuilt ranks, ``%dp export`` writes it
into ``train.py``, ``%dp resize`` and ``%dp setup`` ask whether a model was
wrapped.  Each step is a frozen record of what the notebook asked for -- a
``%%dp --setup`` cell, the wrap, the gradient-sync timing hooks, the data, a
checkpoint loaded -- so readers match on the step's type (``record.last(WrapStep)``), never on an
engine function's dotted name.  A call step knows the engine entry point it
replays (:mod:`dpnb.engine.entrypoints`) and its arguments; nothing here
communicates: the session sends the call (``cluster.call(*step.call())``).

The train calls since the wrap are :attr:`TrainingState.train_log
<dpnb.session.training_state.TrainingState>` beside this record; the runtime keeps
only its cell history (:attr:`dpnb.cluster.Engines.history`).

:meth:`SetupRecord.to_record` writes the JSON a kept cluster's record has
always held under ``setup_log`` (kind, label, code, dotted, args, kwargs), so
a cluster kept by an older dpnb attaches and replays the same steps.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import ClassVar

from ..core.cellgraph import cell_summary
from dpnb.engine import entrypoints as ep

log = logging.getLogger(__name__)

#: steps kept (the oldest go first, with a warning)
SETUP_MAX = 200


@dataclass(frozen=True)
class SetupCell:
    """A ``%%dp --setup`` cell that succeeded on every rank: its code, and ``seq``,
    the number of its entry in the runtime's history (None: from an older dpnb's
    record, where the history entry was marked instead; matched by its code)."""

    code: str
    seq: int | None = None

    @property
    def label(self) -> str:
        return f"cell: {cell_summary(self.code)}"

    def to_record(self) -> dict:
        return {"kind": "cell", "label": self.label, "code": self.code, "dotted": "",
                "args": [], "kwargs": {}, **({} if self.seq is None else {"seq": self.seq})}


@dataclass(frozen=True)
class _CallStep:
    """An engine call that built state on every rank; replayed as it was sent."""

    entry: ClassVar[str]  # the engine entry point (dpnb.engine.entrypoints)

    @property
    def label(self) -> str:  # pragma: no cover - each step says its own
        raise NotImplementedError

    def call(self) -> tuple[str, tuple, dict]:
        """``(entry point, args, kwargs)`` as ``cluster.call`` takes them."""
        raise NotImplementedError  # pragma: no cover

    def to_record(self) -> dict:
        dotted, args, kwargs = self.call()
        return {"kind": "call", "label": self.label, "code": "", "dotted": dotted,
                "args": list(args), "kwargs": dict(kwargs)}


@dataclass(frozen=True)
class WrapStep(_CallStep):
    """``%dp wrap``: the model's name, the strategy, the options as given."""

    entry: ClassVar[str] = ep.WRAP
    model: str
    strategy: str = "ddp"
    opts: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"wrap {self.model} ({self.strategy})"

    def call(self) -> tuple[str, tuple, dict]:
        return self.entry, (self.model, self.strategy), dict(self.opts)


@dataclass(frozen=True)
class WatchStep(_CallStep):
    """The gradient-sync view's timing hooks, put in after each wrap (a view's, not the job's)."""

    entry: ClassVar[str] = ep.WATCH

    @property
    def label(self) -> str:
        return "gradsync timing hooks"

    def call(self) -> tuple[str, tuple, dict]:
        return self.entry, (), {}


@dataclass(frozen=True)
class DataStep(_CallStep):
    """``%dp data``: the dataset's name and how it is shuffled."""

    entry: ClassVar[str] = ep.SET_DATA
    dataset: str
    seed: int = 0
    shuffle: bool = True

    @property
    def label(self) -> str:
        return f"data {self.dataset}"

    def call(self) -> tuple[str, tuple, dict]:
        return self.entry, (self.dataset,), {"seed": self.seed, "shuffle": self.shuffle}


@dataclass(frozen=True)
class LoadStep:
    """A checkpoint loaded into the wrapped model (``%dp load``, or a resume from
    disk): from here the state is that checkpoint's, at its step.

    Not replayed: a resume loads its own checkpoint after the replay, and an
    exported job its own (taken at export).  It is where the training calls
    since it start counting (``%dp export``'s ``--from-scratch`` loads it first).
    """

    path: str
    step: int

    @property
    def label(self) -> str:
        return f"load {self.path} (step {self.step:,})"

    def to_record(self) -> dict:
        return {"kind": "load", "label": self.label, "code": "", "dotted": "",
                "args": [self.path, self.step], "kwargs": {}}


CallStep = WrapStep | WatchStep | DataStep
Step = SetupCell | CallStep | LoadStep


def step_from_record(d: dict) -> Step:
    """One :meth:`to_record` entry (or an older dpnb's ``setup_log`` entry) back as a step."""
    if d.get("kind") == "cell":
        return SetupCell(d.get("code", ""), d.get("seq"))
    if d.get("kind") == "load":
        path, step = d.get("args") or []
        return LoadStep(str(path), int(step))
    dotted, args, kw = d.get("dotted"), list(d.get("args") or []), dict(d.get("kwargs") or {})
    dotted = ep.RENAMED.get(dotted, dotted)  # a record written before the engine's rooms
    if dotted == ep.WRAP:
        return WrapStep(args[0], args[1] if len(args) > 1 else kw.pop("strategy", "ddp"), kw)
    if dotted == ep.WATCH:
        return WatchStep()
    if dotted == ep.SET_DATA:
        return DataStep(args[0], **kw)
    raise ValueError(f"unknown setup step {dotted!r}")


class SetupRecord:
    """The session's steps that built the ranks' state, in order; bounded."""

    def __init__(self, limit: int = SETUP_MAX):
        self.entries: collections.deque[Step] = collections.deque(maxlen=limit)
        self.dropped = 0

    def add(self, step: Step) -> None:
        if len(self.entries) == self.entries.maxlen:
            self.dropped += 1
            log.warning("setup log full (%d entries): dropping the oldest", self.entries.maxlen)
        self.entries.append(step)

    def cells(self) -> list[SetupCell]:
        return [e for e in self.entries if isinstance(e, SetupCell)]

    def marks(self, rec) -> bool:
        """Is the runtime's history entry ``rec`` one of the setup cells recorded here?"""
        cells = self.cells()
        return any(c.seq == rec.seq for c in cells if c.seq is not None) or \
            any(c.code == rec.code for c in cells if c.seq is None)

    def calls(self) -> list[CallStep]:
        """The engine calls a replay sends again, in order (cells and loads are not)."""
        return [e for e in self.entries if isinstance(e, (WrapStep, WatchStep, DataStep))]

    def base(self) -> LoadStep | None:
        """The checkpoint the current model's state starts from: the last load
        after the last wrap (None: the freshly wrapped model)."""
        for e in reversed(self.entries):
            if isinstance(e, LoadStep):
                return e
            if isinstance(e, WrapStep):
                return None
        return None

    def last(self, kind: type) -> Step | None:
        """The latest step of type ``kind`` (``WrapStep``, ``DataStep`` ...), or None."""
        found = [e for e in self.entries if isinstance(e, kind)]
        return found[-1] if found else None

    @property
    def wrapped(self) -> bool:
        """A model was wrapped: there is something to resume, resize or export."""
        return self.last(WrapStep) is not None

    def describe(self) -> list[str]:
        out = [f"{i + 1}. {e.label}" for i, e in enumerate(self.entries)]
        if self.dropped:
            out.insert(0, f"({self.dropped} older entries were dropped: the log keeps "
                          f"{self.entries.maxlen})")
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.entries)

    def to_record(self) -> list[dict]:
        return [e.to_record() for e in self.entries]

    @classmethod
    def from_record(cls, entries: list[dict] | None) -> SetupRecord:
        """Read :meth:`to_record` (an older record's unknown step is logged and left out)."""
        out = cls()
        for d in entries or []:
            try:
                out.add(step_from_record(d))
            except (ValueError, IndexError, TypeError) as e:
                log.warning("kept record: setup step %r not understood (%s): left out",
                            d.get("label"), e)
        return out
