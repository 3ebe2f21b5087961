"""Bringing engines up: ipyparallel launchers, probes, rank assignment, the group's settings.

The start is a fixed sequence, each step here a function:

1. :func:`check_start_args` -- bad input fails before any process starts;
2. :func:`make_ipp_cluster`, then the launcher's ``start``
   (:mod:`dpnb.cluster.launchers`) -- a controller and N engines in a fresh
   0700 profile (local engines start together with the controller through
   :mod:`dpnb.engine.boot`);
3. every engine answers ``probe`` (host, address, PID, GPUs);
   :func:`dpnb.cluster.placement.assign_ranks` makes ranks contiguous per
   host, hosts in the order the user gave, like torchrun;
   :func:`choose_backend` picks NCCL only when every engine has a GPU of its
   own;
4. :func:`rank_init_info` is what each rank's ``init_rank`` receives; then
   rank 0 opens the store socket and every rank joins the group (see
   :mod:`dpnb.cluster.group`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from ..core.gpus import NVIDIA_CTL
from ..env import in_kernel
from ..errors import DpnbError, StartError
from .agents import engine_connection_file, import_time_keys
from .gpuplan import device_index
from .launchers import EngineLauncher
from .launchers.local import local_gpu_count
from .processes import StartWatch, engine_logs, stop_ipp, wait_pids_gone
from .types import BACKENDS, LAUNCHERS, RankInfo

log = logging.getLogger(__name__)

#: how long a failed start's processes get to exit after ipyparallel's stop
#: before SIGKILL (a clean stop here takes about a quarter second)
STOP_WAIT_S = 3.0


def parse_gpus(gpus: str | Sequence[int] | None) -> list[int] | None:
    if gpus is None or gpus == "":
        return None
    if isinstance(gpus, str):
        try:
            return [int(g) for g in gpus.split(",") if g.strip() != ""]
        except ValueError:
            raise DpnbError(f"bad --gpus {gpus!r}: give device ordinals like '0,1,2,3'") from None
    return [int(g) for g in gpus]


def check_start_args(n, backend: str, engines: str, timeout: float, threads: int | None,
                     gpus, seed: int | None = None) -> list[int] | None:
    """Validate ``%dp start``'s arguments; return the parsed GPU list."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DpnbError(f"-n must be a whole number of engines >= 1 (got {n!r}); try -n 2")
    if backend not in BACKENDS:
        raise DpnbError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if engines not in LAUNCHERS:
        raise DpnbError(f"unknown launcher {engines!r}: choose one of {', '.join(LAUNCHERS)}")
    if timeout is not None and not (timeout > 0):
        raise DpnbError(f"--timeout must be > 0 seconds (got {timeout}); e.g. --timeout 30")
    if threads is not None and threads < 1:
        raise DpnbError(f"--threads must be >= 1 (got {threads})")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2 ** 63 - 2 ** 16):
        raise DpnbError(f"--seed must be a whole number from 0 to 2**63 - 65537 (got {seed!r}): "
                        f"rank r seeds its generators with seed + r; e.g. --seed 0")
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


def parse_env(env) -> tuple[tuple[str, str], ...]:
    """``["A=1", "B=x"]`` (or a dict) -> ``(("A", "1"), ("B", "x"))``, names checked."""
    if not env:
        return ()
    pairs = list(env.items()) if isinstance(env, dict) else []
    if not isinstance(env, dict):
        for item in env:
            key, sep, value = str(item).partition("=")
            if not sep:
                raise DpnbError(f"--env {item!r}: give KEY=VALUE, e.g. --env GLOO_SOCKET_IFNAME=eth1")
            pairs.append((key, value))
    for key, _ in pairs:
        if not key or not (key.replace("_", "a").isalnum() and not key[0].isdigit()):
            raise DpnbError(f"--env {key!r}=...: a variable name is letters, digits and _ "
                            f"(not starting with a digit)")
    return tuple((str(k), str(v)) for k, v in pairs)


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


def heartbeat_ms(n: int) -> int:
    """The controller's heartbeat period: short for a few engines, where
    waiting for the next beat is most of a warm start (250 ms: a 2-rank start
    1.7 s instead of 2.0-3.4 s at 1 s); 1 s from 9 engines on, where the
    controller -- which also routes every cell -- would beat 32+ engines 4
    times a second for a start that takes 10 s anyway.  Either way an engine
    may miss 30 s of beats before it counts as dead."""
    return 250 if n <= 8 else 1000


def make_ipp_cluster(n: int, launcher: EngineLauncher, profile_dir: str,
                     start_timeout: float):
    """An unstarted ``ipyparallel.Cluster`` configured for dpnb and ``launcher``."""
    import ipyparallel as ipp  # imports zmq and tornado: only when a cluster starts

    icluster = ipp.Cluster(
        n=n, engines=launcher.ipp_engines, profile_dir=profile_dir,
        log=_quiet_ipp_log(), engine_timeout=int(start_timeout),
        shutdown_atexit=not launcher.spec.kept, parent=None,
        controller_ip=launcher.controller_ip(),
    )
    # An engine counts as registered only once the controller's heart monitor
    # has seen it beat, by default every 3 s: up to 3 s of every start spent
    # waiting (with a warm zygote, most of a two-rank start).
    period = heartbeat_ms(n)
    icluster.controller_args = [*icluster.controller_args, f"--HeartMonitor.period={period}",
                                f"--HeartMonitor.max_heartmonitor_misses={30_000 // period}"]
    launcher.configure(icluster, profile_dir)
    return icluster


def controller_address(icluster) -> str:
    """The address engines connect to (passed to their probe to find their route)."""


    try:
        with open(engine_connection_file(icluster)) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        log.info("engine connection file not readable (%s); assuming loopback", e)
        return "127.0.0.1"
    iface = str(info.get("interface", "")).rpartition("/")[2]
    return iface if iface not in ("", "*", "0.0.0.0") else str(info.get("location") or "127.0.0.1")


def zygote_default(asked: bool | None) -> bool:
    """Whether local engines are forked from one zygote: as asked, else on
    hosts without an NVIDIA driver.  A CUDA context made before a fork is
    unusable in the children; the zygote never makes one on purpose, but
    that is untested on GPU hosts (no GPU here), so they keep one Python per
    engine unless ``zygote=True``."""
    if asked is not None:
        return bool(asked)
    return not os.path.exists(NVIDIA_CTL)


def host_zygote_for(engines: str, *, kept: bool, asked: bool | None, env: dict[str, str]) -> str:
    """How ssh hosts' agents start their engines: forked from the agent once it has
    imported torch ("on", asked), by the :func:`zygote_default` rule read on each
    host itself ("auto": no NVIDIA driver there), or one Python each ("off").

    Forked, a replacement engine is ready in well under a second instead of a
    fresh interpreter's import of torch (4.1-4.5 s to a usable engine on the
    storm's namespace hosts, ``benchmarks/storm.py``).  Off when asked, for
    other launchers, for a kept cluster, and when ``--env`` sets a variable
    torch reads while it loads: the agent imported torch before it was told."""
    if engines != "ssh" or kept or asked is False or import_time_keys(env):
        return "off"
    return "on" if asked else "auto"


def zygote_for(engines: str, *, kept: bool, asked: bool | None) -> bool:
    """Whether ``--engines ENGINES`` forks its engines from a zygote: local engines
    only, never for a kept cluster (a zygote's engines end with its pipe to
    this kernel), else :func:`zygote_default`."""
    return engines == "local" and not kept and zygote_default(asked)


#: ``DPNB_PREWARM=0`` turns off the zygote ``%load_ext dpnb`` starts ahead
PREWARM_ENV = "DPNB_PREWARM"


def prewarm_wanted() -> bool:
    """Whether ``%load_ext dpnb`` starts a zygote ahead of ``%dp start``: where
    the zygote is the default, unless ``DPNB_PREWARM=0``."""
    return zygote_default(None) and os.environ.get(PREWARM_ENV, "1") != "0"


def bring_up(n: int, launcher: EngineLauncher, start_timeout: float, warm=None):
    """Controller and engines in a fresh 0700 profile: ``(icluster, client,
    profile_dir)``.  The launcher owns every process from here on (its
    ``spawned``, ``ipp``, ``client``); a failed start -- here, or later with
    :func:`tear_down` -- leaves no folder and no process."""
    launcher.begin()  # every process from here on is this start's
    profile_dir = tempfile.mkdtemp(prefix="dpnb-profile-")  # 0700: keys stay private
    # a kernel killed from here on leaves nothing running: the reaper watches already
    watch = StartWatch(profile_dir, launcher.spawned)
    try:
        icluster = make_ipp_cluster(n, launcher, profile_dir, start_timeout)
        launcher.bind(icluster, None)
        try:
            client = launcher.start(icluster, n, start_timeout, warm)
        except (DpnbError, StartError):
            raise
        except Exception as e:
            raise StartError(f"could not start {n} engines with the {launcher.name} launcher: "
                             f"{type(e).__name__}: {e}{engine_logs(icluster)}") from None
        launcher.bind(icluster, client)
        watch.write()  # every engine listed now, not a period later
        return icluster, client, profile_dir, watch
    except BaseException:
        tear_down(launcher, profile_dir, watch)
        raise


def tear_down(launcher: EngineLauncher, profile_dir: str, watch: StartWatch) -> None:
    """Undo a start that failed part-way: ipyparallel's stop and the launcher's
    close first, then every process the launcher's start spawned that outlived
    them (ipyparallel's stop of a half-started controller can fail, or return
    before its schedulers exit) gets SIGKILL after a short wait."""
    left = launcher.spawned.since()  # before the stop: a dying parent's children are reparented
    if launcher.client is not None:
        launcher.client.close()
    launcher.close()
    if launcher.ipp is not None:
        stop_ipp(launcher.ipp)
    wait_pids_gone(left, timeout=STOP_WAIT_S)
    watch.close()
    shutil.rmtree(profile_dir, ignore_errors=True)


def rank_init_info(ri: RankInfo, *, world_size: int, backend: str, master_addr: str,
                   master_port: int, timeout_s: float, threads: int, local: bool,
                   watch_ppid: int | None, token: str | None = None,
                   env: dict[str, str] | None = None, nnodes: int = 1,
                   seed: int | None = None, run_id: str = "") -> dict[str, Any]:
    """What :func:`dpnb.engine.setup.init_rank` receives for rank ``ri``.

    ``token`` opens the engine's side door (:mod:`dpnb.engine.sidedoor`), a
    UNIX socket in the owner's private folder for local clusters and a port
    on the rank's own address otherwise.  ``seed``: ``--seed`` (None: each
    engine seeds itself from fresh entropy; :mod:`dpnb.engine.proc.seeding`).
    ``run_id``: the cluster's ``TORCHELASTIC_RUN_ID`` (one value on every
    rank, as torchrun's rendezvous id).
    """
    return dict(rank=ri.rank, world_size=world_size, local_rank=ri.local_rank,
                local_world_size=ri.local_world_size, node_rank=ri.node_rank,
                backend=backend, device_index=device_index(ri),
                visible_devices=ri.visible_devices, device_fallback=ri.device_fallback,
                own_gpu=ri.own_gpu,
                master_addr=master_addr,
                master_port=master_port, timeout_s=timeout_s, threads=threads,
                local_cluster=local, watch_ppid=watch_ppid, token=token,
                door_addr="unix" if local else ri.ip, ifname=ri.ifname,
                env=dict(env or {}), nnodes=nnodes, widgets=in_kernel(), seed=seed,
                run_id=run_id)
