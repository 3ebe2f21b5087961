"""Model-state bytes resident on this rank *during* forward and backward (collective).

The distributed story.  After a step every ZeRO stage looks alike from the
outside: ZeRO-2 and ZeRO-3 both keep 1/N of the parameters, gradients and
optimizer state.  They differ inside the step.  FSDP2 all-gathers a unit's
parameters just before the unit runs; ZeRO-3 (``reshard_after_forward=True``)
frees the gathered copy as soon as the unit's forward ends and gathers it
again for its backward, while ZeRO-2 keeps every gathered unit from its
forward until its backward is done.  So at the end of the forward a ZeRO-2
rank holds the whole model unsharded, a ZeRO-3 rank little more than its
shard: that is the memory ZeRO-3 saves, paid for with a second all-gather
per unit.  DDP and ZeRO-1 hold the whole model throughout.

:func:`measure_step` runs one ordinary training step (the same collective
as ``%dp train --steps 1``; every rank calls it with the same arguments)
with light hooks on every module that owns parameters: after each module's
forward, and when the gradient of its output arrives in backward (just
before that module's own backward runs, when FSDP has gathered its unit),
it counts the bytes of every parameter and gradient storage this rank holds
at that moment -- the sharded parameters, whatever is gathered, and the
gradients -- each storage once.  Activations are not counted: this is the
model state ZeRO shards.  The hooks are removed when the step ends, however
it ends.  No extra communication: the step's own collectives are the only ones.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from dpnb.engine.train.measure import _StorageCounter, state_bytes
from dpnb.engine.state import get_state
from dpnb.core.trainargs import TrainArgs
from dpnb.engine.train.call import train
from dpnb.engine.train.train_state import train_state

__all__ = ["ResidencyProbe", "measure_step"]

PHASES = ("forward", "backward")


class ResidencyProbe:
    """Peak parameter and gradient bytes this rank holds in forward and in backward.

    ``sharded`` are the parameter tensors as they are between steps (FSDP2:
    this rank's shards); while FSDP has a unit gathered, the module's
    parameters are the gathered tensors instead, so both are counted.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.sharded = list(module.parameters())
        self.peak = {ph: {"params": 0, "grads": 0, "total": 0} for ph in PHASES}
        self.samples = {ph: 0 for ph in PHASES}
        self._handles: list = []
        owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        for m in owners:
            self._handles.append(m.register_forward_hook(self._after_forward))

    def _after_forward(self, _module, _inputs, output) -> None:
        self.sample("forward")
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # fires when d(loss)/d(output) is ready: this module's backward is next
            out.register_hook(self._before_backward)

    def _before_backward(self, grad):
        self.sample("backward")
        return grad

    def sample(self, phase: str) -> None:
        pc, gc = _StorageCounter(), _StorageCounter()
        # the shards, and the gathered tensors that stand in for them while a unit is unsharded
        for p in itertools.chain(self.sharded, self.module.parameters()):
            pc.add(p)
            gc.add(p.grad)
        pk = self.peak[phase]
        pk["params"] = max(pk["params"], pc.bytes)
        pk["grads"] = max(pk["grads"], gc.bytes)
        pk["total"] = max(pk["total"], pc.bytes + gc.bytes)
        self.samples[phase] += 1

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _full_param_bytes(module: nn.Module) -> int:
    """Bytes of the whole (unsharded) model's parameters, from their global shapes."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure_step(ns: dict, micro_batch: int, grad_accum: int = 1, seq_len: int | None = None) -> dict:
    """One training step with a :class:`ResidencyProbe` armed (collective: the step's).

    Returns builtins: ``rank``, ``strategy``, ``step`` (the step just taken),
    ``peak`` (per phase: ``params``, ``grads``, ``total`` bytes), ``samples``
    (moments counted per phase), ``full_param_bytes`` (the whole model,
    unsharded) and ``after`` (the same count once the step is over).
    """
    st = train_state(ns)
    module = st.module
    full = _full_param_bytes(module)  # DTensor numel is the global one
    probe = ResidencyProbe(module)
    try:
        summary = train(ns, TrainArgs(steps=1, micro_batch=micro_batch, grad_accum=grad_accum,
                                      seq_len=seq_len, publish=False, record=False))
    finally:
        probe.detach()
    after = state_bytes(module, None)
    return {"rank": get_state(ns).rank, "strategy": st.strategy, "step": summary.last_step,
            "peak": probe.peak, "samples": probe.samples, "full_param_bytes": full,
            "after": {"params": after["params"], "grads": after["grads"]}}
