"""The one place engine code talks to an accelerator, device-neutrally.

dpnb's training, timing and memory code runs the same lines on CPU (gloo, in
CI) and on a GPU: it asks this module, which goes through torch's
device-neutral APIs (``torch.accelerator``, ``torch.Event``,
``torch.amp.GradScaler(device_type)``), and each function is a no-op or
``None`` on the CPU.  So the code CI runs is the code a GPU runs, except the
few things that are CUDA-specific by nature, listed here:

* NCCL is CUDA's collective library: ``backend="nccl"`` means CUDA devices,
  one per rank (NCCL refuses two ranks on one device) -- :data:`NCCL_DEVICE`;
* which GPU a rank drives, and which ones its process is shown
  (``CUDA_VISIBLE_DEVICES``), is planned in :mod:`dpnb.core.gpus`; counting
  them here never initialises CUDA, so that plan can still be applied.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

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
    """Accelerator devices visible to this process (0 on a CPU-only host).

    CUDA GPUs are counted with NVML (:func:`gpu_ids`), which leaves CUDA
    uninitialised: ``CUDA_VISIBLE_DEVICES`` is read once, when CUDA
    initialises, and :func:`show_gpus` sets it after the count.  Only where
    NVML cannot tell does the count go through the CUDA runtime (and then the
    mapping of ``--gpus`` to ``LOCAL_RANK`` falls back, said in the log)."""
    ids = gpu_ids()
    if ids is not None:
        return len(ids)
    try:
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    except RuntimeError as e:  # a broken driver must not stop a CPU cluster
        log.warning("an accelerator is installed but not usable: %s", e)
        return 0


def gpu_ids() -> tuple[str, ...] | None:
    """UUIDs of the CUDA GPUs this process may use, in CUDA's order, from NVML
    (no CUDA context, no ``cuInit``); None where NVML cannot tell (a torch
    without CUDA, no NVIDIA driver library, MIG, an error)."""
    cuda = torch.cuda
    if not cuda._is_compiled():
        return None
    try:
        every = cuda._raw_device_uuid_nvml()  # every GPU of the host, NVML's order
        shown = cuda._parse_visible_devices()  # CUDA_VISIBLE_DEVICES, as CUDA reads it
    except (OSError, AttributeError) as e:  # no libnvidia-ml; or a torch without these
        log.info("GPUs not countable with NVML (%s: %s); asking the CUDA runtime",
                 type(e).__name__, e)
        return None
    if every is None:
        return None
    out: list[str] = []
    for entry in shown:
        if isinstance(entry, int):
            if not 0 <= entry < len(every):
                break  # CUDA stops at the first invalid entry
            out.append(every[entry])
            continue
        hit = [u for u in every if u.startswith(entry if entry.startswith("GPU-") else "GPU-" + entry)]
        if len(hit) != 1:  # MIG-..., or a prefix NVML does not resolve: let CUDA count
            return None
        out.append(hit[0])
    return tuple(out)


def driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """True once this process has loaded the CUDA driver (``libcuda``).

    ``torch.cuda.is_initialized()`` says only whether torch made its CUDA
    context; ``torch.cuda.is_available()`` or ``device_count()`` without NVML
    already ran ``cuInit``, after which ``CUDA_VISIBLE_DEVICES`` is fixed and
    a forked child cannot use the GPU at all."""
    try:
        with open(maps) as f:
            return any("/libcuda.so" in line for line in f)
    except OSError as e:  # no /proc (not Linux): say "loaded" only if torch knows
        log.debug("cannot read %s: %s", maps, e)
        return torch.cuda._is_compiled() and torch.cuda.is_initialized()


#: where :func:`show_gpus` keeps the list the engine was started with (a
#: re-probe after a restart or resize must plan from that, not from dpnb's own)
_BEFORE, _UNSET = "DPNB_CUDA_VISIBLE_DEVICES_BEFORE", "<unset>"


def inherited_visible() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the engine was started with it (None: unset)."""

    value = os.environ.get(_BEFORE, os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET))
    return None if value == _UNSET else value


def show_gpus(visible: str, maps: str = "/proc/self/maps") -> bool:
    """Give this process ``CUDA_VISIBLE_DEVICES=visible`` (``--gpus``), before
    CUDA reads it.  True if it now holds; False, with the reason logged, when
    CUDA was initialised earlier with another list (then the rank keeps the
    GPU numbering it had, and ``LOCAL_RANK`` does not name its device)."""

    if not visible or os.environ.get("CUDA_VISIBLE_DEVICES") == visible:
        return True
    os.environ.setdefault(_BEFORE, os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET))
    if driver_loaded(maps):
        log.warning("CUDA was initialised in this engine before --gpus could be applied "
                    "(CUDA_VISIBLE_DEVICES=%s, wanted %s)", os.environ.get("CUDA_VISIBLE_DEVICES"),
                    visible)
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return True


def set_device(dev: Any) -> None:
    """Make ``dev`` this process's current device (kernels, NCCL, allocations)."""
    dev = torch.device(dev)
    if is_accel(dev) and dev.index is not None:
        torch.accelerator.set_device_index(dev.index)


def synchronize(dev: Any) -> None:
    """Wait for the device's queued work (a step's kernels belong in its time)."""
    if is_accel(dev):
        torch.accelerator.synchronize(torch.device(dev))


def queued_work(dev: Any) -> bool:
    """True while ``dev``'s stream still has work queued that has not run
    (asked from another thread, without waiting): under NCCL, what a rank
    blocked in a synchronize waits for -- a collective kernel that spins
    until every peer joins.  False on the CPU."""
    if not is_accel(dev):
        return False
    try:
        return not torch.accelerator.current_stream(torch.device(dev)).query()
    except RuntimeError as e:  # a device in an error state: say nothing is known
        log.debug("querying the stream of %s: %s", dev, e)
        return False


def mark_collective(dev: Any) -> Any:
    """An event recorded on ``dev``'s current stream just after a collective
    was queued on it (``None`` on the CPU): until the event has passed, that
    collective's kernel has not completed.  Recording is a host-side
    enqueue (a few microseconds, no wait), so the cell guard marks every
    collective it passes under NCCL."""
    if not is_accel(dev):
        return None
    return torch.accelerator.current_stream(torch.device(dev)).record_event()


def collective_pending(mark: Any) -> bool:
    """Whether the collective ``mark`` follows (:func:`mark_collective`) has
    not completed yet (asked from another thread, without waiting).  A rank
    in a device wait behind plain compute -- evaluation, timing code -- has
    no such collective: it is running, not waiting for a peer."""
    if mark is None:
        return False
    try:
        return not mark.query()
    except RuntimeError as e:  # a device in an error state: say nothing is known
        log.debug("querying the last collective's event: %s", e)
        return False


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


def grad_scaler(dev: Any, group: Any = None) -> Any:
    """Loss scaling for fp16 on ``dev``'s device type.

    With ``group`` (FSDP: each rank holds a shard of the gradients, so each
    sees only its own overflow) the found-inf flags are all-reduced over it,
    and every rank skips the same steps -- with a per-rank scaler they skip
    different ones and the shards silently part ways.  Flags of shards
    offloaded to the CPU travel on ``dev`` (an NCCL group has no CPU side)."""
    kind = torch.device(dev).type
    if group is None:
        return torch.amp.GradScaler(kind)
    # lazy: FSDP/DTensor load only for the strategy that uses them
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(kind, process_group=group)


def ddp_device_ids(dev: Any) -> list[int] | None:
    """``DistributedDataParallel(device_ids=...)``: the rank's device, or None on CPU."""
    dev = torch.device(dev)
    if not is_accel(dev):
        return None
    return [dev.index if dev.index is not None else torch.accelerator.current_device_index()]
