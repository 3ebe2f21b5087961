"""Bringing engines up: ipyparallel launchers, probes, rank assignment, the group's settings.

The start is a fixed sequence, each step here a function:

1. :func:`check_start_args` -- bad input fails before any process starts;
2. :func:`make_ipp_cluster` / :func:`start_engines` -- a controller and N
   engines in a fresh 0700 profile (local engines start together with the
   controller through :mod:`dpnb.engine.boot`);
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

import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from ..env import in_kernel
from ..errors import DpnbError
from .gpuplan import device_index
from .types import BACKENDS, LAUNCHERS, LaunchSpec, RankInfo

log = logging.getLogger(__name__)


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


def make_ipp_cluster(n: int, spec: LaunchSpec, profile_dir: str, start_timeout: float):
    """An unstarted ``ipyparallel.Cluster`` configured for dpnb."""
    import ipyparallel as ipp

    engines = spec.engines
    icluster = ipp.Cluster(
        n=n, engines="local" if engines == "ssh" else engines, profile_dir=profile_dir,
        log=_quiet_ipp_log(), engine_timeout=int(start_timeout), shutdown_atexit=not spec.kept,
        parent=None, controller_ip=controller_ip(spec),
    )
    # An engine counts as registered only once the controller's heart monitor
    # has seen it beat, by default every 3 s: up to 3 s of every start spent
    # waiting (with a warm zygote, most of a two-rank start).
    period = heartbeat_ms(n)
    icluster.controller_args = [*icluster.controller_args, f"--HeartMonitor.period={period}",
                                f"--HeartMonitor.max_heartmonitor_misses={30_000 // period}"]
    env = spec.env_dict
    if engines in ("mpi", "slurm"):  # started by srun / mpiexec on the nodes
        cls = "MPIEngineSetLauncher" if engines == "mpi" else "SlurmEngineSetLauncher"
        icluster.config[cls].engine_cmd = [spec.remote_python or sys.executable, "-m",
                                           "dpnb.engine.boot"]
    if engines == "mpi":
        # mpiexec refuses to run as root and to place more ranks than cores
        # unless told; dpnb's own processes are what it launches here.
        # Open MPI passes variables to ranks on other hosts only when named (-x).
        forward = [*env, "IPP_CONNECTION_INFO", "IPP_PROFILE_DIR", "IPP_CLUSTER_ID"]
        icluster.config.MPILauncher.mpi_args = [*spec.launcher_args,
                                                *(a for k in forward for a in ("-x", k))]
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        icluster.config.MPIEngineSetLauncher.environment = env
    elif engines == "slurm":
        icluster.config.SlurmEngineSetLauncher.environment = env  # sbatch --export=ALL
        # ipyparallel writes the script into its work_dir, the notebook's
        # folder; an absolute name keeps it in the profile, removed at stop
        icluster.config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
            profile_dir, "slurm_engine.sbatch")
        if spec.launcher_args:
            apply_launcher_args(icluster, engines, spec.launcher_args)
    elif engines == "local":
        if spec.launcher_args:
            apply_launcher_args(icluster, engines, spec.launcher_args)
        icluster.config.LocalEngineSetLauncher.environment = env
    return icluster


def local_address_towards(addr: str) -> str:
    """This host's address on the route to ``addr`` (a UDP connect sends nothing)."""
    import socket

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def controller_ip(spec: LaunchSpec) -> str:
    """Where the controller listens.

    Engines on this host (local, mpiexec without a hostfile) reach it on
    loopback and nothing listens outside.  For ssh clusters: this host's
    address on the route to the first host, so the engines can reach it
    whatever this host's name resolves to.  Batch engines run on nodes we
    cannot see from here: all interfaces (ipyparallel signs every message
    with the cluster's key).
    """
    if spec.controller_ip:
        return spec.controller_ip
    if spec.engines == "ssh":
        from .agents import resolve

        first = spec.launcher_args[0].partition("=")[0].strip()  # checked by parse_hosts
        return local_address_towards(resolve(first, spec.ssh_config))
    if spec.engines == "mpi":
        first = mpi_first_host(spec.launcher_args)
        return local_address_towards(first) if first else "127.0.0.1"
    if spec.engines == "slurm":
        ctl = slurmctld_address()
        if ctl:
            return local_address_towards(ctl)
    return "127.0.0.1" if spec.engines == "local" else "*"


def mpi_first_host(args: Sequence[str]) -> str | None:
    """The first host mpiexec's ``--hostfile F`` / ``--host a,b`` names (None: this host)."""
    import socket

    args = list(args)
    for i, a in enumerate(args[:-1]):
        host = None
        if a in ("--hostfile", "-hostfile", "--machinefile", "-machinefile"):
            try:
                with open(args[i + 1]) as f:
                    host = next((ln.split()[0] for ln in f
                                 if ln.strip() and not ln.lstrip().startswith("#")), None)
            except OSError as e:
                raise DpnbError(f"mpiexec hostfile {args[i + 1]!r}: {e.strerror}") from None
        elif a in ("--host", "-host", "-H"):
            host = args[i + 1].split(",")[0].split(":")[0]
        if host:
            if host in ("localhost", "127.0.0.1", socket.gethostname()):
                return None
            return socket.gethostbyname(host)
    return None


def slurmctld_address() -> str | None:
    """The address of the Slurm controller (``SlurmctldHost``), which the compute
    nodes reach by definition; None if ``scontrol`` cannot tell."""
    import re
    import socket
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=15).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.info("scontrol show config: %s", e)
        return None
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    if not m:
        return None
    try:
        return m.group(2) or socket.gethostbyname(m.group(1))
    except OSError:
        return None


def controller_address(icluster) -> str:
    """The address engines connect to (passed to their probe to find their route)."""
    import json

    from .agents import engine_connection_file

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
    return not os.path.exists("/dev/nvidiactl")


#: ``DPNB_PREWARM=0`` turns off the zygote ``%load_ext dpnb`` starts ahead
PREWARM_ENV = "DPNB_PREWARM"


def prewarm_wanted() -> bool:
    """Whether ``%load_ext dpnb`` starts a zygote ahead of ``%dp start``: where
    the zygote is the default, unless ``DPNB_PREWARM=0``."""
    return zygote_default(None) and os.environ.get(PREWARM_ENV, "1") != "0"


def start_engines(icluster, n: int, spec: LaunchSpec, timeout: float, warm=None):
    """Start the controller and ``n`` engines; return ``(client, agents or None)``."""
    if spec.engines == "ssh":
        from .agents import start_over_ssh

        return start_over_ssh(icluster, n, spec, timeout)
    if spec.engines != "local":
        return icluster.start_and_connect_sync(n=n), None
    if spec.zygote:
        from .agents import start_zygote

        return start_zygote(icluster, n, spec, timeout, warm)
    return _start_overlapped(icluster, n, timeout), None


def bring_up(n: int, spec: LaunchSpec, start_timeout: float, warm=None):
    """Controller and engines in a fresh 0700 profile: ``(icluster, client, agents,
    profile_dir)``.  A failed start leaves no folder and no process."""
    import tempfile

    from ..errors import StartError
    from .processes import engine_logs

    profile_dir = tempfile.mkdtemp(prefix="dpnb-profile-")  # 0700: keys stay private
    icluster = client = agents = None
    try:
        icluster = make_ipp_cluster(n, spec, profile_dir, start_timeout)
        try:
            client, agents = start_engines(icluster, n, spec, start_timeout, warm)
        except (DpnbError, StartError):
            raise
        except Exception as e:
            raise StartError(f"could not start {n} engines with the {spec.engines} launcher: "
                             f"{type(e).__name__}: {e}{engine_logs(icluster)}") from None
        return icluster, client, agents, profile_dir
    except BaseException:
        tear_down(icluster, client, agents, profile_dir)
        raise


def tear_down(icluster, client, agents, profile_dir: str) -> None:
    """Undo a start that failed part-way."""
    import shutil

    from .processes import stop_ipp

    if client is not None:
        client.close()
    if agents is not None:
        agents.close()
    if icluster is not None:
        stop_ipp(icluster)
    shutil.rmtree(profile_dir, ignore_errors=True)


def preload_setting(n: int, cores: int) -> str:
    """What local engines preload while the cluster starts: everything the first
    wrap needs (``all``), or -- more engines than cores -- ``torch`` only: the
    background preload of DDP/FSDP/dynamo would compete with the start itself."""
    return "all" if n <= cores else "torch"


def _start_overlapped(icluster, n: int, timeout: float):
    """Start local engines together with the controller, not after it.

    ``start_and_connect`` waits for the controller's connection file before
    it launches engines; launched through :mod:`dpnb.engine.boot`, engines
    import torch and ipyparallel while the controller starts, then read the
    connection file themselves.
    """
    from ..engine.setup import PRELOAD_ENV
    from .agents import engine_connection_file

    launcher = icluster.config.LocalEngineSetLauncher
    launcher.engine_cmd = [sys.executable, "-m", "dpnb.engine.boot"]
    launcher.environment = {
        **dict(launcher.get("environment", {}) or {}),
        "DPNB_CONNECTION_FILE": engine_connection_file(icluster),
        "DPNB_CONNECTION_WAIT": str(timeout),
        PRELOAD_ENV: preload_setting(n, os.cpu_count() or 1),
    }
    icluster.send_engines_connection_env = False
    icluster.start_engines_sync(n)
    icluster.start_controller_sync()
    client = icluster.connect_client_sync()
    client.wait_for_engines(n, timeout=timeout)
    return client


def slurm_engine_template(options: Sequence[str]) -> str:
    """ipyparallel's engine job script with ``options`` as ``#SBATCH`` lines
    (braces doubled: ipyparallel formats the script).  ``--output`` is
    written here because ipyparallel adds it only to its own template: without
    it Slurm writes ``slurm-JOBID.out`` into the notebook's folder."""
    lines = "".join(f"#SBATCH {o.replace('{', '{{').replace('}', '}}')}\n" for o in options)
    return ("#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n"
            "#SBATCH --output={output_file}\n"
            f"{lines}srun {{program_and_args}}\n")


def apply_launcher_args(icluster, engines: str, args: Sequence[str]) -> None:
    """Pass launcher settings through to ipyparallel.

    slurm: ``KEY=VALUE`` for ``SlurmEngineSetLauncher`` traits (``queue``
    (the partition), ``account``, ``timelimit``, ``qos``), plus ``nodes`` and
    ``options`` (sbatch options, e.g. ``--ntasks-per-node=4``), written into
    the job script here: ipyparallel keeps an ``options`` setting but writes
    nothing of it.  ssh hosts are read by :func:`dpnb.cluster.agents.parse_hosts`.
    """
    pairs = []
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise DpnbError(f"--launcher-arg {a!r}: use KEY=VALUE for {engines} "
                            f"(e.g. {'queue=gpu' if engines == 'slurm' else 'node1=4'})")
        pairs.append((key.strip(), value.strip()))
    if engines == "slurm":
        allowed = {"queue", "account", "timelimit", "qos", "options", "nodes"}
        extra = []
        for key, value in pairs:
            if key not in allowed:
                raise DpnbError(f"--launcher-arg {key}=...: slurm takes {', '.join(sorted(allowed))}")
            if key == "nodes":
                extra.append(f"--nodes={value}")
            elif key == "options":
                extra += shlex.split(value)
            else:
                setattr(icluster.config.SlurmEngineSetLauncher, key, value)
        if extra:
            icluster.config.SlurmEngineSetLauncher.batch_template = slurm_engine_template(extra)
    else:
        raise DpnbError(f"the {engines} launcher takes no --launcher-arg")


def rank_init_info(ri: RankInfo, *, world_size: int, backend: str, master_addr: str,
                   master_port: int, timeout_s: float, threads: int, local: bool,
                   watch_ppid: int | None, token: str | None = None,
                   env: dict[str, str] | None = None, nnodes: int = 1) -> dict[str, Any]:
    """What :func:`dpnb.engine.setup.init_rank` receives for rank ``ri``.

    ``token`` opens the engine's side door (:mod:`dpnb.engine.sidedoor`), a
    UNIX socket in the owner's private folder for local clusters and a port
    on the rank's own address otherwise.
    """
    return dict(rank=ri.rank, world_size=world_size, local_rank=ri.local_rank,
                local_world_size=ri.local_world_size, node_rank=ri.node_rank,
                backend=backend, device_index=device_index(ri),
                visible_devices=ri.visible_devices, device_fallback=ri.device_fallback,
                master_addr=master_addr,
                master_port=master_port, timeout_s=timeout_s, threads=threads,
                local_cluster=local, watch_ppid=watch_ppid, token=token,
                door_addr="unix" if local else ri.ip, ifname=ri.ifname,
                env=dict(env or {}), nnodes=nnodes, widgets=in_kernel())
