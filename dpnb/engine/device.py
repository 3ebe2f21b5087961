"""The one place engine code talks to an accelerator, device-neutrally.

dpnb's training, timing and memory code runs the same lines on CPU (gloo, in
CI) and on a GPU: it asks this module, which goes through torch's
device-neutral APIs (``torch.accelerator``, ``torch.Event``,
``torch.amp.GradScaler(device_type)``), and each function is a no-op or
``None`` on the CPU.  So the code CI runs is the code a GPU runs, except the
few things that are CUDA-specific by nature, listed here:

* NCCL is CUDA's collective library: ``backend="nccl"`` means CUDA devices,
  one per rank (NCCL refuses two ranks on one device) -- :data:`NCCL_DEVICE`;
* the device index of a rank is ``gpus[local_rank]`` under NCCL
  (``dpnb.cluster.launch.with_devices``).
"""

from __future__ import annotations

from typing import Any

import logging

import torch

log = logging.getLogger("dpnb.engine.device")

NCCL_DEVICE = "cuda"  # the only device type NCCL drives


def is_accel(dev: Any) -> bool:
    """True for a GPU-like device (anything but the host CPU)."""
    return torch.device(dev).type not in ("cpu", "meta")


def accelerator_type() -> str | None:
    """``"cuda"`` (or ``"xpu"``, ``"mps"``, ...) when this process sees one, else None."""
    try:
        acc = torch.accelerator.current_accelerator()
    except RuntimeError as e:  # a broken driver: treat the host as CPU-only
        log.warning("an accelerator is installed but not usable: %s", e)
        return None
    return acc.type if acc is not None else None


def device_count() -> int:
    """Accelerator devices visible to this process (0 on a CPU-only host)."""
    try:
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    except RuntimeError as e:  # a broken driver must not stop a CPU cluster
        log.warning("an accelerator is installed but not usable: %s", e)
        return 0


def set_device(dev: Any) -> None:
    """Make ``dev`` this process's current device (kernels, NCCL, allocations)."""
    dev = torch.device(dev)
    if is_accel(dev) and dev.index is not None:
        torch.accelerator.set_device_index(dev.index)


def synchronize(dev: Any) -> None:
    """Wait for the device's queued work (a step's kernels belong in its time)."""
    if is_accel(dev):
        torch.accelerator.synchronize(torch.device(dev))


def memory_allocated(dev: Any) -> int | None:
    return int(torch.accelerator.memory_allocated(torch.device(dev))) if is_accel(dev) else None


def memory_reserved(dev: Any) -> int | None:
    return int(torch.accelerator.memory_reserved(torch.device(dev))) if is_accel(dev) else None


def max_memory_allocated(dev: Any) -> int | None:
    return int(torch.accelerator.max_memory_allocated(torch.device(dev))) if is_accel(dev) else None


def reset_peak_memory(dev: Any) -> None:
    if is_accel(dev):
        torch.accelerator.reset_peak_memory_stats(torch.device(dev))


def timing_event(dev: Any) -> Any:
    """A recorded timing event on ``dev``'s current stream (accelerators only)."""
    ev = torch.Event(device=torch.device(dev), enable_timing=True)
    ev.record()
    return ev


def is_event(x: Any) -> bool:
    return isinstance(x, torch.Event)


def grad_scaler(dev: Any) -> Any:
    """Loss scaling for fp16 on ``dev``'s device type."""
    return torch.amp.GradScaler(torch.device(dev).type)


def ddp_device_ids(dev: Any) -> list[int] | None:
    """``DistributedDataParallel(device_ids=...)``: the rank's device, or None on CPU."""
    dev = torch.device(dev)
    if not is_accel(dev):
        return None
    return [dev.index if dev.index is not None else torch.accelerator.current_device_index()]
