"""Which GPU each rank drives, and which GPUs its process is shown.

The contract user code relies on is torchrun's: every process on a host sees
the same GPUs, and ``torch.cuda.set_device(LOCAL_RANK)`` (what Accelerate,
Lightning and the Hugging Face Trainer do) picks the process's own.  So
``%dp start --gpus 2,3`` is done the way a torchrun user does it,
``CUDA_VISIBLE_DEVICES=2,3`` for every engine of the host, and rank
``local_rank`` drives ``cuda:<local_rank>`` -- not ``cuda:2`` with
``LOCAL_RANK=0``, which sends the user's ``set_device(local_rank)`` to
another rank's GPU.  The variable must be set before the engine first
touches CUDA (:func:`dpnb.engine.device.show_gpus`); the engines count their
GPUs with NVML, which does not initialise CUDA, for that reason.

A launcher can instead bind one GPU per task (Slurm ``--gpus-per-task=1``,
device cgroups): each engine of a host then sees a different GPU, all of
them as ``cuda:0``.  The host has as many GPUs as the engines see together,
each rank drives the one it is shown, and ``--gpus`` has nothing left to
choose; its code sees ``LOCAL_RANK=0`` of 1, as each task does under ``srun
torchrun --nproc-per-node=1`` (:func:`dpnb.engine.proc.workerenv.torchrun_env`),
so ``set_device(LOCAL_RANK)`` names that one GPU.  Pure: the engines' probes come in, a plan per engine goes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError

#: present where an NVIDIA driver is loaded (a host fact read without touching CUDA)
NVIDIA_CTL = "/dev/nvidiactl"


@dataclass(frozen=True)
class EngineGpus:
    """What one engine's probe saw: ``count`` GPUs, their NVML ``ids``
    (UUIDs, in CUDA's order; None where NVML could not tell) and the
    ``CUDA_VISIBLE_DEVICES`` it was started with (None when unset)."""

    engine_id: int
    local_rank: int
    count: int
    ids: tuple[str, ...] | None = None
    inherited: str | None = None


@dataclass(frozen=True)
class GpuPick:
    """Rank's device index as its process numbers them, and the
    ``CUDA_VISIBLE_DEVICES`` to give that process ("": leave it as it is)."""

    index: int
    visible: str = ""


def bound_per_task(engines: Sequence[EngineGpus]) -> bool:
    """True when a launcher gave each engine of one host its own GPUs (no
    GPU seen by two engines), as Slurm's ``--gpus-per-task`` does."""
    if len(engines) < 2 or any(not e.ids for e in engines):
        return False
    seen: set[str] = set()
    for e in engines:
        if seen & set(e.ids or ()):
            return False
        seen |= set(e.ids or ())
    return True


def host_gpus(engines: Sequence[EngineGpus]) -> int:
    """GPUs the engines of one host can use between them."""
    if bound_per_task(engines):
        return sum(e.count for e in engines)
    return max((e.count for e in engines), default=0)


def visible_list(inherited: str | None, chosen: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` that shows ``chosen`` (ordinals as this
    engine numbers its GPUs now) in that order: a subset of what the engine
    was started with, if anything."""
    if inherited is None:
        return ",".join(str(g) for g in chosen)
    entries = [x.strip() for x in inherited.split(",") if x.strip()]
    bad = [g for g in chosen if not 0 <= g < len(entries)]
    if bad:
        raise ConfigError(
            f"--gpus {','.join(map(str, chosen))}: ordinal {bad[0]} is beyond the "
            f"{len(entries)} GPUs the engines are shown (CUDA_VISIBLE_DEVICES={inherited}); "
            f"--gpus counts within that list, so give ordinals below {len(entries)}")
    return ",".join(entries[g] for g in chosen)


def pick_gpus(engines: Sequence[EngineGpus], chosen: Sequence[int] | None) -> dict[int, GpuPick]:
    """``{engine_id: GpuPick}`` for the engines of one host under NCCL."""
    if bound_per_task(engines):
        if chosen:
            raise ConfigError(
                f"--gpus {','.join(map(str, chosen))}: the launcher already gave each of this "
                f"host's {len(engines)} engines its own GPU (each sees {engines[0].count}, none "
                f"shared, as with Slurm --gpus-per-task); drop --gpus, or launch with all GPUs "
                f"visible to every task (e.g. --gpus-per-node)")
        return {e.engine_id: GpuPick(0) for e in engines}
    if not chosen:
        return {e.engine_id: GpuPick(e.local_rank) for e in engines}
    return {e.engine_id: GpuPick(e.local_rank, visible_list(e.inherited, chosen))
            for e in engines}
