"""Bringing engines up: ipyparallel launchers, probes, rank assignment, the group's settings.

The start is a fixed sequence, each step here a function:

1. :func:`check_start_args` -- bad input fails before any process starts;
2. :func:`make_ipp_cluster` / :func:`start_engines` -- a controller and N
   engines in a fresh 0700 profile (local engines start together with the
   controller through :mod:`dpnb.engine.boot`);
3. every engine answers ``probe`` (host, address, PID, GPUs);
   :func:`assign_ranks` makes ranks contiguous per host, hosts ordered by
   lowest engine id, like torchrun; :func:`choose_backend` picks NCCL only
   when every engine has a GPU of its own;
4. :func:`rank_init_info` is what each rank's ``init_rank`` receives; then
   rank 0 opens the store socket and every rank joins the group (see
   :mod:`dpnb.cluster.group`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Sequence

from ..errors import DpnbError
from .types import BACKENDS, LAUNCHERS, RankInfo

log = logging.getLogger("dpnb.launch")


def parse_gpus(gpus: str | Sequence[int] | None) -> list[int] | None:
    if gpus is None or gpus == "":
        return None
    if isinstance(gpus, str):
        try:
            return [int(g) for g in gpus.split(",") if g.strip() != ""]
        except ValueError:
            raise DpnbError(f"bad --gpus {gpus!r}: give device ordinals like '0,1,2,3'") from None
    return [int(g) for g in gpus]


def local_gpu_count() -> int:
    """GPUs this host's processes see (the engines' own count, asked here)."""
    from ..engine.device import device_count  # imports torch: only for --backend nccl

    return device_count()


def check_start_args(n, backend: str, engines: str, timeout: float, threads: int | None,
                     gpus) -> list[int] | None:
    """Validate ``%dp start``'s arguments; return the parsed GPU list."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DpnbError(f"-n must be a whole number of engines >= 1 (got {n!r}); try -n 2")
    if backend not in BACKENDS:
        raise DpnbError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if engines not in LAUNCHERS:
        raise DpnbError(f"unknown launcher {engines!r}: choose one of {', '.join(LAUNCHERS)}")
    if not (timeout > 0):
        raise DpnbError(f"--timeout must be > 0 seconds (got {timeout}); e.g. --timeout 30")
    if threads is not None and threads < 1:
        raise DpnbError(f"--threads must be >= 1 (got {threads})")
    gpu_list = parse_gpus(gpus)
    if backend == "nccl" and gpu_list is not None and len(set(gpu_list)) < len(gpu_list):
        twice = sorted({g for g in gpu_list if gpu_list.count(g) > 1})
        raise DpnbError(f"--gpus {gpus} puts two ranks on cuda:{twice[0]}: NCCL refuses two ranks "
                        f"on one device; give each rank its own GPU, or use --backend gloo")
    if engines == "local" and backend == "nccl":
        ngpu = local_gpu_count()
        avail = len(gpu_list) if gpu_list is not None else ngpu
        if gpu_list is not None and any(g >= ngpu or g < 0 for g in gpu_list):
            raise DpnbError(f"--gpus {gpus} names devices this host does not have "
                            f"(it has {ngpu} GPU{'s' if ngpu != 1 else ''})")
        if n > avail:
            raise DpnbError(
                f"-n {n} with --backend nccl needs {n} GPUs but this host has {avail}"
                f"{' selected' if gpu_list is not None else ''}: use -n {max(avail, 1)}"
                f"{'' if avail else ' with --backend gloo'} or --backend gloo")
    return gpu_list


def _quiet_ipp_log() -> logging.Logger:
    # ipyparallel logs every engine's exit (with its output) as a warning when
    # the cluster stops; in a notebook that lands in the cell as red stderr.
    # Start failures read the engine output directly instead.
    ipp_log = logging.getLogger("dpnb.ipyparallel")
    ipp_log.setLevel(logging.ERROR)
    ipp_log.propagate = False
    if not ipp_log.handlers:
        ipp_log.addHandler(logging.NullHandler())
    return ipp_log


def make_ipp_cluster(n: int, engines: str, profile_dir: str, start_timeout: float,
                     launcher_args: Sequence[str] | None, controller_ip: str | None):
    """An unstarted ``ipyparallel.Cluster`` configured for dpnb."""
    import ipyparallel as ipp

    icluster = ipp.Cluster(
        n=n, engines=engines, profile_dir=profile_dir, log=_quiet_ipp_log(),
        engine_timeout=int(start_timeout), shutdown_atexit=True, parent=None,
        # Engines on this host (local, mpiexec without a hostfile) reach the
        # controller on loopback; nothing listens outside.  Batch / ssh
        # engines run elsewhere, so the controller listens on all interfaces;
        # ipyparallel signs every message with the cluster's key.
        controller_ip=controller_ip or ("127.0.0.1" if engines in ("local", "mpi") else "*"),
    )
    # An engine counts as registered only once the controller's heart monitor
    # has seen it beat, by default every 3 s: up to 3 s of every start spent
    # waiting.  Beat every second and allow 30 misses (still 30 s to answer).
    icluster.controller_args = [*icluster.controller_args, "--HeartMonitor.period=1000",
                                "--HeartMonitor.max_heartmonitor_misses=30"]
    if engines == "mpi":
        # mpiexec refuses to run as root and to place more ranks than cores
        # unless told; dpnb's own processes are what it launches here.
        icluster.config.MPILauncher.mpi_args = list(launcher_args or [])
        if os.geteuid() == 0:
            env = icluster.config.MPILauncher.get("environment", {})
            icluster.config.MPIEngineSetLauncher.environment = {
                **env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    elif launcher_args:
        apply_launcher_args(icluster, engines, launcher_args)
    return icluster


def start_engines(icluster, n: int, engines: str, timeout: float):
    """Start the controller and ``n`` engines; return a connected client."""
    if engines != "local":
        return icluster.start_and_connect_sync(n=n)
    return _start_overlapped(icluster, n, timeout)


def _start_overlapped(icluster, n: int, timeout: float):
    """Start local engines together with the controller, not after it.

    ``start_and_connect`` waits for the controller's connection file before
    it launches engines; launched through :mod:`dpnb.engine.boot`, engines
    import torch and ipyparallel while the controller starts, then read the
    connection file themselves.
    """
    launcher = icluster.config.LocalEngineSetLauncher
    launcher.engine_cmd = [sys.executable, "-m", "dpnb.engine.boot"]
    launcher.environment = {
        **dict(launcher.get("environment", {})),
        "DPNB_CONNECTION_FILE": os.path.join(
            icluster.profile_dir, "security", f"ipcontroller-{icluster.cluster_id}-engine.json"),
        "DPNB_CONNECTION_WAIT": str(timeout),
    }
    icluster.send_engines_connection_env = False
    icluster.start_engines_sync(n)
    icluster.start_controller_sync()
    client = icluster.connect_client_sync()
    client.wait_for_engines(n, timeout=timeout)
    return client


def apply_launcher_args(icluster, engines: str, args: Sequence[str]) -> None:
    """Pass launcher settings through to ipyparallel.

    slurm: ``KEY=VALUE`` for ``SlurmEngineSetLauncher`` traits (``queue``
    (the partition), ``account``, ``timelimit``, ``qos``, ``options``);
    ssh: ``HOST=N`` engines per host.
    """
    pairs = []
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise DpnbError(f"--launcher-arg {a!r}: use KEY=VALUE for {engines} "
                            f"(e.g. {'queue=gpu' if engines == 'slurm' else 'node1=4'})")
        pairs.append((key.strip(), value.strip()))
    if engines == "slurm":
        allowed = {"queue", "account", "timelimit", "qos", "options"}
        for key, value in pairs:
            if key not in allowed:
                raise DpnbError(f"--launcher-arg {key}=...: slurm takes {', '.join(sorted(allowed))}")
            setattr(icluster.config.SlurmEngineSetLauncher, key, value)
    elif engines == "ssh":
        try:
            icluster.config.SSHEngineSetLauncher.engines = {h: int(n) for h, n in pairs}
        except ValueError:
            raise DpnbError("--launcher-arg for ssh is HOST=N (engines on that host)") from None
    else:
        raise DpnbError(f"the {engines} launcher takes no --launcher-arg")


def assign_ranks(probes: dict[int, dict]) -> list[RankInfo]:
    """Ranks contiguous per host, hosts ordered by their lowest engine id.

    This is torchrun's layout: ``rank = node_rank * local_world_size +
    local_rank`` when hosts run equal numbers of engines, and local rank (and
    so the GPU) comes from the position among the engines on the same host.
    """
    by_host: dict[str, list[int]] = {}
    for eid in sorted(probes):
        by_host.setdefault(probes[eid]["host"], []).append(eid)
    ranks: list[RankInfo] = []
    for node_rank, (host, eids) in enumerate(by_host.items()):
        for local_rank, eid in enumerate(eids):
            p = probes[eid]
            ranks.append(RankInfo(rank=len(ranks), engine_id=eid, host=host, ip=p["ip"],
                                  pid=p["pid"], local_rank=local_rank,
                                  local_world_size=len(eids), node_rank=node_rank, device=""))
    return ranks


def choose_backend(backend: str, ranks: list[RankInfo], probes: dict[int, dict],
                   gpus: list[int] | None) -> str:
    """``auto`` -> nccl when every host has a GPU per engine, else gloo; check ``nccl``."""
    gpus_on = {r.host: probes[r.engine_id]["cuda_devices"] for r in ranks}
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


def with_devices(ranks: list[RankInfo], backend: str, gpus: list[int] | None) -> list[RankInfo]:
    """Each rank's device: ``cuda:<gpus[local_rank]>`` under NCCL, else ``cpu``."""
    out = []
    for r in ranks:
        dev = "cpu"
        if backend == "nccl":
            dev = f"cuda:{gpus[r.local_rank] if gpus else r.local_rank}"
        out.append(RankInfo(**{**r.__dict__, "device": dev}))
    return out


def device_index(ri: RankInfo) -> int | None:
    return int(ri.device.split(":")[1]) if ri.device.startswith("cuda:") else None


def rank_init_info(ri: RankInfo, *, world_size: int, backend: str, master_addr: str,
                   master_port: int, timeout_s: float, threads: int, local: bool,
                   watch_ppid: int | None, token: str | None = None) -> dict[str, Any]:
    """What :func:`dpnb.engine.setup.init_rank` receives for rank ``ri``.

    ``token`` opens the engine's side door (:mod:`dpnb.engine.sidedoor`), on
    loopback for local clusters and on the rank's own address otherwise.
    """
    return dict(rank=ri.rank, world_size=world_size, local_rank=ri.local_rank,
                local_world_size=ri.local_world_size, node_rank=ri.node_rank,
                backend=backend, device_index=device_index(ri), master_addr=master_addr,
                master_port=master_port, timeout_s=timeout_s, threads=threads,
                local_cluster=local, watch_ppid=watch_ppid, token=token,
                door_addr="127.0.0.1" if local else ri.ip)
