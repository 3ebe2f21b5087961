"""Where a rank is on the network, and which interfaces its libraries use.

Read by :func:`dpnb.engine.setup.probe` (the launcher's rank, the address
towards the controller, its interface) and :func:`dpnb.engine.setup.init_rank`
(the communication settings each rank gets unless the user set them).
Standard library only at import; runs on the ranks.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


#: the rank a launcher gave this process: Slurm's task id (nodelist order),
#: Open MPI's / PMI's world rank (hostfile order)
LAUNCH_RANK_VARS = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launch_rank() -> int | None:
    for var in LAUNCH_RANK_VARS:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):  # not set by this launcher, or not a number: next one
            continue
    return None


def route_address(dest: str) -> str:
    """This host's source address towards ``dest`` (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in dest else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            return s.getsockname()[0]
    except OSError as e:
        log.warning("no route to the controller at %s (%s); using the hostname's address",
                    dest, e)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def data_interface(master_addr: str) -> str:
    """The interface this host sends to ``master_addr`` (rank 0's address, or
    ``--master-addr``) on: the one NCCL's peers are reached through.  ""
    when there is no route (NCCL then picks its own)."""
    try:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # a UDP connect sends nothing
            return interface_of(s.getsockname()[0])
    except OSError as e:
        log.warning("no route to the group's address %s (%s); NCCL picks its interface",
                    master_addr, e)
        return ""


def interface_of(ip: str) -> str:
    """The name of the interface that holds ``ip`` ("" if none does)."""
    import psutil  # a dependency of ipyparallel

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return ""


#: the group dpnb forms for ``--backend nccl`` (an exported job too): NCCL
#: for CUDA tensors, gloo for CPU ones, as torch forms it for a script naming
#: both; a script adopted with that string (or "nccl") finds its CPU
#: collectives working instead of "No backend type associated with device
#: type cpu".  Cost: gloo's one TCP pair per peer at formation; dpnb's own
#: collectives stay on CUDA tensors (tests/unit/test_comm_device.py).
NCCL_GROUP = "cpu:gloo,cuda:nccl"


def group_backend(backend: str) -> str:
    """The backend string ``init_process_group`` is given for the cluster's ``backend``."""
    return NCCL_GROUP if backend == "nccl" else backend


def backend_env(info: dict, folder: str = "") -> dict[str, str]:
    """The communication settings a rank gets unless the user set them (``--env``).

    * ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``: gloo binds its pair
      sockets, and NCCL its bootstrap, to the hostname's address (127.0.1.1
      on a stock Debian node; on a multi-NIC node maybe one the others cannot
      reach, and ``ncclCommInitRank`` hangs).  A local cluster stays on
      loopback (a container's hostname often resolves to an address that is
      not routable from itself).  Across hosts gloo takes the interface that
      reaches the controller (``ifname``: its traffic is light, and that
      route is the one probed); NCCL takes the one that reaches the group's
      address (``data_ifname``: rank 0's, or ``--master-addr``), because the
      controller may sit behind a management or VPN interface that NCCL's
      gradients must not be forced onto; no route there, nothing set (NCCL's
      own choice, as under torchrun).
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): torch's default
      (3) tears the whole process down when an NCCL op outlives the group
      timeout -- a slow checkpoint or one rank compiling would cost the
      engine and everything built on it.  With 2 the watchdog aborts the
      communicators and the op raises; dpnb then re-forms the group.
    * ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``: the flight recorder's dumps (after
      a timeout the watchdog saw) go to this user's private ``folder``
      (:func:`dpnb.engine.proc.private.private_dir`), not torch's default
      ``/tmp/nccl_trace_rank_<r>``, which every user of the host shares.
    * ``TORCH_NCCL_ENABLE_MONITORING=0``: torch's heartbeat monitor, after an
      error its watchdog saw, signals every rank through the store and kills
      the process unless the group was shut down -- an engine, with the
      user's model in it, gone minutes after an error the user had caught, or
      after the release dpnb itself made.  dpnb watches its engines itself
      (the side door, ``%dp status``, the deadlock verdicts) and re-forms the
      group; the monitor would also poll rank 0's store about once a second.
    """
    ifname = "lo" if info.get("local_cluster") else info.get("ifname") or ""
    out = {}
    if ifname:
        out["GLOO_SOCKET_IFNAME"] = ifname
    if info.get("backend") == "nccl":
        nccl_if = "lo" if info.get("local_cluster") else info.get("data_ifname") or ""
        if nccl_if:
            out["NCCL_SOCKET_IFNAME"] = nccl_if
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        out["TORCH_NCCL_ENABLE_MONITORING"] = "0"
        if folder:
            out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(folder, "nccl_trace_rank_")
    return out
