"""What the training layer keeps on one engine, typed.

:class:`TrainState` (the wrapped model, its optimizer, the step counter and
the per-step :class:`StepRecord` history) lives in the engine's
:class:`~dpnb.engine.state.EngineState` (slot ``train``); :class:`DataState`
says where this rank is in its shard of the dataset.  Nothing here
communicates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn
from torch.utils.data import DistributedSampler, default_collate

from dpnb.core.errors import UserError, ViewError
from dpnb.engine.train.measure import BucketRecorder
from dpnb.engine.state import get_state

MAX_RECORDS = 100_000
# Counting the bytes every step costs ~1 ms of Python on a small model
# (about 1 % of a step); they change only when tensors are (re)allocated.
BYTES_EVERY = 25
# DDP's bucket timeline (per-parameter ready hooks, a completion callback per
# bucket that gloo's thread runs under the GIL) is kept for one step in this
# many, and always for a call's last step -- the step %dp gradsync shows.
RECORD_EVERY = 10


def records_buckets(record: bool | None, default_on: bool, i: int, n_steps: int,
                    step: int) -> bool:
    """Whether step ``i`` of an ``n_steps`` call (global index ``step``) keeps
    its DDP bucket timeline.  ``record=True``: every step; ``False``: none;
    ``None``: sampled when recording is on by default -- the last step of the
    call and every ``RECORD_EVERY``-th global step (the hooks cost a few
    percent of a short step; what the views read stays recorded)."""
    if record is not None:
        return bool(record)
    return default_on and (i == n_steps - 1 or step % RECORD_EVERY == 0)


class TrainError(UserError, RuntimeError):
    """A mistake the user can fix; the message says what to do."""


def choice(value: str, allowed: tuple, what: str) -> str:
    """``value`` matched case- and dash-insensitively against ``allowed``."""
    v = str(value).lower().replace("-", "")
    for a in allowed:
        if v == a.replace("-", ""):
            return a
    raise TrainError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")


# --------------------------------------------------------------------------
# state kept on the engine


@dataclass
class DataState:
    """Where this rank is in the (sharded) dataset.

    Position is kept as the number of *global* samples consumed in the current
    epoch.  Because ``DistributedSampler`` deals the epoch's permutation
    round-robin (rank ``r`` gets ``perm[r::N]``), the first ``n`` global
    samples are always ``perm[:n]`` whatever ``N`` is -- so a run can resume
    at the same place under another world size."""

    dataset: Any
    name: str
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0  # global samples consumed in this epoch
    _indices: list | None = None
    _key: tuple | None = None
    noted: set = field(default_factory=set)  # (len, micro_batch, grad_accum, ws) said once

    def per_rank_len(self, world_size: int) -> int:
        return len(self.dataset) // world_size

    def _rank_indices(self, rank: int, world_size: int) -> list:
        key = (self.epoch, rank, world_size)
        if self._key != key:
            sampler = DistributedSampler(
                self.dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=self.shuffle,
                seed=self.seed,
                drop_last=True,
            )
            sampler.set_epoch(self.epoch)
            self._indices = list(iter(sampler))
            self._key = key
        return self._indices

    def ensure_room(self, per_rank_need: int, rank: int, world_size: int) -> None:
        """Start the next epoch if this one has fewer than ``per_rank_need``
        samples left per rank (the tail of an epoch is dropped)."""
        if self.offset % world_size:
            # Resumed under a world size that does not divide the position.
            self.offset -= self.offset % world_size
        pos = self.offset // world_size
        if pos + per_rank_need > len(self._rank_indices(rank, world_size)):
            self.epoch += 1
            self.offset = 0

    def micro_batch(self, k: int, batch: int, rank: int, world_size: int):
        idx = self._rank_indices(rank, world_size)
        start = self.offset // world_size + k * batch
        items = [self.dataset[i] for i in idx[start : start + batch]]
        return default_collate(items), len(items)

    def usage_note(self, micro_batch: int, grad_accum: int, world_size: int,
                   call_steps: int) -> str | None:
        """Once per setting: how many samples an epoch uses and drops, and why --
        said by the call of ``call_steps`` steps that reaches the end of an
        epoch, where the drop happens; a shorter call drops nothing.  No
        separate rule for a large share: what an epoch drops is less than one
        step's samples per rank, so a share worth saying means few steps to an
        epoch, and the first call to reach its end says it."""
        n = len(self.dataset)
        per_rank = n // world_size
        need = micro_batch * grad_accum
        steps = per_rank // need
        used = steps * need * world_size
        key = (n, micro_batch, grad_accum, world_size)
        if used == n or key in self.noted:
            return None
        pos = (self.offset - self.offset % world_size) // world_size  # as ensure_room reads it
        if call_steps < (per_rank - pos) // need:  # the call ends before the epoch's last step
            return None
        self.noted.add(key)
        why = []
        if n % world_size:
            why.append(f"DistributedSampler gives each of the {world_size} ranks {per_rank} "
                       f"(drop_last: {n % world_size} left over)")
        if per_rank % (micro_batch * grad_accum):
            why.append(f"a step takes micro-batch {micro_batch} x grad-accum {grad_accum} = "
                       f"{micro_batch * grad_accum} per rank, so {steps} step"
                       f"{'s' if steps != 1 else ''} use {steps * micro_batch * grad_accum} of "
                       f"each rank's {per_rank}")
        return (f"an epoch uses {used} of the {n} samples and drops {n - used}: "
                + "; ".join(why))

    def summary(self, world_size: int) -> dict:
        return {
            "dataset": self.name,
            "len": len(self.dataset),
            "per_rank": self.per_rank_len(world_size),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }


@dataclass
class TrainState:
    """Everything the training layer keeps on one engine."""

    strategy: str
    config: dict  # the wrap() arguments, for checkpoints and re-binding
    model_name: str
    model_out: str
    optimizer_out: str
    module: nn.Module  # the original module (FSDP2 shards it in place)
    wrapped: nn.Module  # DDP(module) or the FSDP-sharded module
    optimizer: Any
    world_size: int
    generation: int
    device: Any
    mesh: Any = None
    recorder: BucketRecorder | None = None
    scaler: Any = None
    ddp_kwargs: dict = field(default_factory=dict)
    step: int = 0  # optimizer steps taken so far (global step index)
    lr_scale_applied: float = 1.0
    data: DataState | None = None
    record_default: bool = True
    records: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))  # StepRecord



@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as this rank saw it (sent to the notebook as a dict).

    ``loss`` is the global mean over the global batch; ``compute_s`` /
    ``compute_s_all`` are this rank's / every rank's time in work that waits
    for no other rank (non-final micro-batches, the final forward, the
    straggle delay, the optimizer step), so a slow rank shows a larger value
    and the others' ``step_time_s - compute_s`` is mostly waiting.
    ``bytes`` is :func:`~dpnb.engine.train.measure.state_bytes` right after
    ``optimizer.step()`` (None when not recording), counted every
    ``BYTES_EVERY`` steps and on a call's first and last step, with the
    allocator's peak over that step, and carried in between (``counted_at_step``).
    The final backward, which overlaps the gradient all-reduce, is not in
    ``compute_s``; under FSDP forward also all-gathers, and ZeRO-1's step
    includes its parameter broadcast.
    """

    step: int
    epoch: int
    rank: int
    loss: float
    loss_rank: float
    step_time_s: float
    samples: int
    tokens: int | None
    global_batch: int
    micro_batch: int
    grad_accum: int
    dp: int
    lr: float
    compute_s: float
    compute_s_all: list
    straggle_delay_s: float
    samples_per_s: float | None
    tokens_per_s: float | None
    t_start: float
    t_end: float
    strategy: str
    bytes: dict | None

    def as_dict(self) -> dict:
        return asdict(self)


def train_state(ns: dict) -> TrainState:
    """This engine's :class:`TrainState`, with a clear error if none exists."""
    st = get_state(ns).train
    if st is None:
        raise TrainError(
            "no model is wrapped on this engine yet: run `%dp wrap MODEL "
            "--strategy ddp` (dpnb.engine.train.training.wrap(ns, 'MODEL', 'ddp')) first"
        )
    return st


def require_bound(ns: dict) -> TrainState:
    """The TrainState, provided its wrappers use the current process group.

    After the group is re-formed, the ``on_reform`` callback re-binds them.
    If it did not run (e.g. some engines were replaced by fresh ones), going
    on would run collectives over a dead group or hang, so say what to do."""
    es = get_state(ns)
    st = train_state(ns)
    if st.generation != es.generation:
        raise TrainError(
            "the process group was re-formed after this model was wrapped and the "
            "wrapper was not re-bound to the new group: run `%dp wrap` again on every "
            "rank (or dpnb.engine.train.training.rebind(ns) on every rank if all of them "
            "still hold their model)"
        )
    return st


def viewed_state(ns: dict) -> TrainState:
    """The TrainState for a view, or a :class:`ViewError` saying to wrap and train first."""
    st = get_state(ns).train
    if st is None:
        raise ViewError(
            "no model is wrapped on this engine: run `%dp wrap MODEL --strategy ddp` "
            "and `%dp train` (with recording on) first"
        )
    return st
