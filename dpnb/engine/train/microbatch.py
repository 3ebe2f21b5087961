"""Turning a dataset's samples into a micro-batch on this rank's device, and the default loss.

Local to each rank; no communication.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from dpnb.engine.train.train_state import TrainError


def _to_device(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, dev) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, dev) for k, v in x.items()}
    return x


def _split(batch):
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        for a, b in (("input", "target"), ("x", "y"), ("inputs", "targets")):
            if a in batch and b in batch:
                return batch[a], batch[b]
    raise TrainError(
        "batches are not (input, target) pairs; pass step_fn=your_fn where "
        "your_fn(batch) returns the micro-batch's mean loss"
    )


def default_loss(output, target):
    """MSE for float targets, cross-entropy for integer class/token ids
    (logits ``(..., C)``, targets ``(...)``); computed in float32."""
    if target.dtype.is_floating_point:
        return F.mse_loss(output.float(), target.float())
    logits = output.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _resolve_callable(ns, fn, what):
    if fn is None or callable(fn):
        return fn
    if isinstance(fn, str):
        if fn in ns and callable(ns[fn]):
            return ns[fn]
        raise TrainError(f"there is no function {fn!r} on this rank for {what}; define it in a %%dp cell")
    raise TrainError(f"{what} must be a function or the name of one, got {type(fn).__name__}")


def _arity(fn) -> int:
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(1 for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
