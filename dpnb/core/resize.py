"""What a change of the data-parallel degree does to the batch and the learning rate.

The distributed story
---------------------
``%dp resize -n M`` moves a running job from ``N`` to ``M`` ranks.  Every
optimizer step averages gradients over ``micro_batch × dp × grad_accum``
samples, so changing ``dp`` changes the global batch unless another factor
moves the other way.  There are two honest ways to go on:

* **keep the global batch** (the default): ``grad_accum`` (and, when that
  cannot absorb the change alone, ``micro_batch``) is re-chosen so that
  ``micro_batch' × M × grad_accum' = micro_batch × N × grad_accum``.  The
  optimizer then sees exactly the steps it would have seen on ``N`` ranks --
  the same samples, in the same order (dpnb's data position is counted in
  global samples), so the loss curve does not notice the resize;
* **keep the per-rank work and rescale the learning rate**: the global batch
  becomes ``micro_batch × M × grad_accum`` and the learning rate follows it,
  linearly (Goyal et al. 2017) or with its square root.

Pure arithmetic: no torch, no cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dpnb.core.errors import ConfigError

Keep = Literal["batch", "lr"]
KEEPS: tuple[str, ...] = ("batch", "lr")
LR_RULES: tuple[str, ...] = ("linear", "sqrt")


@dataclass(frozen=True)
class ResizePlan:
    """The batch layout after a resize, and the factor applied to the learning rate."""

    old_dp: int
    new_dp: int
    micro_batch: int
    grad_accum: int
    old_micro_batch: int
    old_grad_accum: int
    lr_factor: float = 1.0

    @property
    def old_global_batch(self) -> int:
        return self.old_micro_batch * self.old_dp * self.old_grad_accum

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.new_dp * self.grad_accum

    def describe(self, lr_rule: str | None = None, lr_now: float | None = None) -> str:
        """One sentence: what the optimizer sees now, and what changed.

        ``lr_rule``: the rule that sets the learning rate instead of this
        plan's factor (train's ``--lr-scale``); ``lr_now``: the rate the ranks
        hold after the rescale.
        """
        was = (f"{self.old_micro_batch} x DP {self.old_dp} x grad-accum {self.old_grad_accum}")
        now = f"{self.micro_batch} x DP {self.new_dp} x grad-accum {self.grad_accum}"
        if self.global_batch == self.old_global_batch:
            return f"global batch {self.global_batch} kept = {now} (was {was})"
        lr = (f"the learning rate follows {lr_rule}" if lr_rule
              else f"learning rate x {self.lr_factor:.4g}"
              + (f" (now {lr_now:.4g})" if lr_now is not None else ""))
        return f"global batch {self.old_global_batch} -> {self.global_batch} = {now}; {lr}"


def plan_resize(micro_batch: int, grad_accum: int, old_dp: int, new_dp: int,
                keep: str = "batch", lr_rule: str = "linear") -> ResizePlan:
    """The layout on ``new_dp`` ranks; raise :class:`ConfigError` when impossible.

    ``keep="batch"``: keep ``micro_batch`` if ``global / (micro_batch × new_dp)``
    is whole, else the largest smaller micro-batch that makes it whole (less
    memory per rank, never more).  ``keep="lr"``: keep micro-batch and
    grad-accum, scale the learning rate by ``new/old`` global batch
    (``lr_rule`` ``linear``) or its square root (``sqrt``).
    """
    for name, v in (("micro_batch", micro_batch), ("grad_accum", grad_accum),
                    ("old_dp", old_dp), ("new_dp", new_dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if keep not in KEEPS:
        raise ConfigError(f"keep must be one of {', '.join(KEEPS)} (got {keep!r})")
    if lr_rule not in LR_RULES:
        raise ConfigError(f"the lr rule must be one of {', '.join(LR_RULES)} (got {lr_rule!r})")
    base = dict(old_dp=old_dp, new_dp=new_dp, old_micro_batch=micro_batch,
                old_grad_accum=grad_accum)
    G = micro_batch * old_dp * grad_accum
    if keep == "lr":
        ratio = new_dp / old_dp
        factor = ratio if lr_rule == "linear" else math.sqrt(ratio)
        return ResizePlan(micro_batch=micro_batch, grad_accum=grad_accum, lr_factor=factor, **base)
    if G % new_dp:
        raise ConfigError(
            f"the global batch {G} = micro-batch {micro_batch} x DP {old_dp} x grad-accum "
            f"{grad_accum} cannot be split over {new_dp} ranks ({G} / {new_dp} is not whole): "
            f"resize to a number of ranks that divides {G}, or keep the per-rank batch and "
            f"rescale the learning rate (--scale-lr linear)")
    per_rank = G // new_dp  # micro_batch' x grad_accum'
    b = next(b for b in range(min(micro_batch, per_rank), 0, -1) if per_rank % b == 0)
    return ResizePlan(micro_batch=b, grad_accum=per_rank // b, **base)
