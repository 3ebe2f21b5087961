"""A ``train`` call checked before anything changes: :class:`Plan`.

Runs on every rank, locally (no communication): every rank validates the
same arguments against the same dataset length and world size, so either all
ranks start the step loop (:mod:`dpnb.engine.train.step`) or all raise the same
one-line :class:`~dpnb.engine.train.train_state.TrainError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpnb.core.strategies import LR_SCALES
from dpnb.core.trainargs import TrainArgs
from dpnb.core.traincounts import count_problem
from dpnb.engine.train.microbatch import _arity, _resolve_callable
from dpnb.engine.train.train_state import TrainError, choice


@dataclass(frozen=True)
class Plan:
    """A validated ``train`` call: nothing has changed yet when this exists."""

    n_steps: int
    micro_batch: int
    grad_accum: int
    world_size: int
    rank: int
    steps_per_epoch: int
    lr_mode: str
    lr_scale: float
    step_fn: Any
    loss_fn: Any
    step_arity: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.grad_accum


def plan(ns, es, data, args: TrainArgs) -> Plan:
    """Check every argument of ``train`` against the data; raise :class:`TrainError`."""
    steps, epochs, step_fn, loss_fn = args.steps, args.epochs, args.step_fn, args.loss_fn
    micro_batch, grad_accum = args.micro_batch, args.grad_accum
    if grad_accum is None:  # hand-written engine code may leave it out, as torchrun code would
        grad_accum = 1
    if step_fn is not None and loss_fn is not None:
        raise TrainError("pass either step_fn or loss_fn, not both")
    if (steps is None) == (epochs is None):
        raise TrainError("give exactly one of --steps S or --epochs E")
    # the notebook's rule too (dpnb.session.verbs): one rule, whoever calls
    problem = count_problem(("micro_batch", "grad_accum"), steps=steps, epochs=epochs,
                            micro_batch=micro_batch, grad_accum=grad_accum)
    if problem:
        raise TrainError(problem)
    ws, B, K = es.world_size, micro_batch, grad_accum
    G = B * ws * K
    per_rank = data.per_rank_len(ws)
    if per_rank < B * K:
        raise TrainError(
            f"dataset {data.name} has {len(data.dataset)} samples, so each of the "
            f"{ws} ranks gets {per_rank}; one step needs micro_batch x grad_accum = "
            f"{B} x {K} = {B * K} per rank (global batch {B} x {ws} ranks x {K} = {G}). "
            "Use a smaller --micro-batch or --grad-accum, or a larger dataset"
        )
    steps_per_epoch = per_rank // (B * K)
    n_steps = steps if steps is not None else epochs * steps_per_epoch
    mode = choice(args.lr_scale, LR_SCALES, "lr scaling")
    ref = args.ref_batch if args.ref_batch is not None else B
    if ref <= 0:
        raise TrainError(f"--ref-batch must be positive, got {ref}")
    step_fn = _resolve_callable(ns, step_fn, "step_fn")
    return Plan(n_steps=n_steps, micro_batch=B, grad_accum=K, world_size=ws, rank=es.rank,
                steps_per_epoch=steps_per_epoch, lr_mode=mode,
                lr_scale={"none": 1.0, "linear": G / ref, "sqrt": math.sqrt(G / ref)}[mode],
                step_fn=step_fn, loss_fn=_resolve_callable(ns, loss_fn, "loss_fn"),
                step_arity=_arity(step_fn) if step_fn is not None else 0)
