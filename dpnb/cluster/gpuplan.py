"""Which backend a cluster uses and which device each rank drives.

Called once the engines have probed themselves (host, GPUs seen, the
``CUDA_VISIBLE_DEVICES`` they were started with) and been given ranks: by the
start, and by ``%dp resize`` for the new layout.  The per-host decision is
:mod:`dpnb.core.gpus` (pure); this module turns probes into its records and
its picks into :class:`~dpnb.cluster.types.RankInfo` fields, which
:func:`dpnb.cluster.launch.rank_init_info` hands to each engine.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.errors import ConfigError
from ..core.gpus import EngineGpus, GpuPick, bound_per_task, host_gpus, pick_gpus
from ..errors import DpnbError
from .types import RankInfo

#: what an engine's probe says of its GPUs (:func:`dpnb.engine.setup.probe`)
GPU_PROBE_KEYS = ("cuda_devices", "gpu_ids", "cuda_visible")

def _engine_gpus(ranks: list[RankInfo], probes: dict[int, dict]) -> dict[str, list[EngineGpus]]:
    """What each host's engines saw of its GPUs, by host."""
    out: dict[str, list[EngineGpus]] = {}
    for r in ranks:
        p = probes[r.engine_id]
        ids = p.get("gpu_ids")
        out.setdefault(r.host, []).append(EngineGpus(
            engine_id=r.engine_id, local_rank=r.local_rank, count=int(p.get("cuda_devices") or 0),
            ids=tuple(ids) if ids else None, inherited=p.get("cuda_visible")))
    return out


def choose_backend(backend: str, ranks: list[RankInfo], probes: dict[int, dict],
                   gpus: list[int] | None) -> str:
    """``auto`` -> nccl when every host has a GPU per engine, else gloo; check ``nccl``.

    A host's GPUs are those its engines see together: under Slurm's
    ``--gpus-per-task=1`` each engine sees one, a different one."""
    gpus_on = {h: host_gpus(e) for h, e in _engine_gpus(ranks, probes).items()}
    per_host = {r.host: r.local_world_size for r in ranks}
    if backend == "auto":
        if not all(gpus_on.values()):
            return "gloo"
        enough = all(gpus_on[h] >= (len(gpus) if gpus else per_host[h]) >= per_host[h]
                     for h in per_host)
        return "nccl" if enough else "gloo"
    if backend == "nccl":
        for h, g in gpus_on.items():
            if g < per_host[h] or (gpus is not None and len(gpus) < per_host[h]):
                raise DpnbError(f"--backend nccl needs one GPU per engine, but host {h} runs "
                                f"{per_host[h]} engines and has {g} GPUs: use fewer engines or gloo")
    return backend


def with_devices(ranks: list[RankInfo], backend: str, gpus: list[int] | None,
                 probes: dict[int, dict] | None = None) -> list[RankInfo]:
    """Each rank's device, and the GPUs its engine is shown (:mod:`dpnb.core.gpus`):
    ``cuda:<local_rank>`` under NCCL, with ``CUDA_VISIBLE_DEVICES`` set to
    ``--gpus`` when given; ``cpu`` otherwise.  Under a launcher that bound
    each engine its own GPU, ``cuda:0`` and ``own_gpu`` (the user's code then
    sees ``LOCAL_RANK=0``: :func:`dpnb.engine.proc.workerenv.torchrun_env`)."""
    if backend != "nccl":
        return [replace(r, device="cpu", visible_devices="", device_fallback=None)
                for r in ranks]
    if probes is None:  # no probes (a re-planned cluster): every engine sees every GPU
        probes = {r.engine_id: {} for r in ranks}
    picks: dict[int, GpuPick] = {}
    own: set[int] = set()  # engines a launcher bound their own GPU (LOCAL_RANK 0 of 1)
    try:
        for engines in _engine_gpus(ranks, probes).values():
            picks.update(pick_gpus(engines, gpus))
            if bound_per_task(engines):
                own.update(e.engine_id for e in engines)
    except ConfigError as e:
        raise DpnbError(str(e)) from None
    return [replace(r, device=f"cuda:{picks[r.engine_id].index}",
                    visible_devices=picks[r.engine_id].visible,
                    device_fallback=gpus[r.local_rank] if gpus else None,
                    own_gpu=r.engine_id in own)
            for r in ranks]


def device_index(ri: RankInfo) -> int | None:
    return int(ri.device.split(":")[1]) if ri.device.startswith("cuda:") else None
