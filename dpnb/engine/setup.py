"""Bringing one engine into the world: rank identity, device, process group.

The notebook calls these by name on every engine.  The order is:

1. :func:`probe` on every engine, so the notebook can see hosts, PIDs and
   GPUs and assign ranks (contiguous per host, by sorted engine id);
2. :func:`listen_store` on rank 0 only: the TCP store of the process group
   is served by rank 0, so rank 0 opens its listening socket (on its own
   address only) and the port is passed to everyone;
3. :func:`init_rank` then :func:`form_group` on every engine *at the same
   time*: ``init_process_group`` is a rendezvous, every rank blocks in it
   until all ``world_size`` ranks have connected to rank 0's store (or the
   timeout passes);
4. after a collective error, :func:`reform_group` on every engine, again all
   at once, on a fresh port: a gloo/NCCL group whose collective timed out or
   whose peer vanished cannot be trusted again, so it is destroyed and a new
   one formed; the user's objects stay, and ``EngineState.on_reform``'s
   callbacks re-bind wrappers (DDP, ZeRO, FSDP) to the new group.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from dpnb import compat
from dpnb.core.timeouts import form_timeout
from dpnb import log as dpnb_log
from dpnb.engine.cell import outcount
from dpnb.engine.proc import process, seeding
from dpnb.engine.proc.preload import start_preload, wait_preload
from dpnb.engine.proc.shell import _shell, user_ns
from dpnb.engine.debugging import tbtext
from dpnb.engine.group.lifecycle import torch_fn  # torch-free at import, like this module
from dpnb.engine.group.netplan import (backend_env, data_interface, group_backend, interface_of, launch_rank,
                      route_address)
from dpnb.engine.group.rebind import rebind_user_objects
from dpnb.engine.state import STATE_NAME, EngineState, get_state
from dpnb.engine.proc.workerenv import as_a_worker, torchrun_env

log = logging.getLogger(__name__)


def probe(controller_addr: str = "127.0.0.1") -> dict:
    """What the notebook needs to assign ranks: host, address, PID, GPUs.

    ``ip`` is the address this engine's host uses on its route to the
    controller, i.e. the address the other hosts can reach it on, not what
    its hostname resolves to (often 127.0.1.1, or nothing, on a compute
    node).  ``ifname`` is the interface holding it: gloo binds its pair
    sockets to the hostname's address unless ``GLOO_SOCKET_IFNAME`` names an
    interface, so :func:`init_rank` sets that for multi-host clusters.
    """
    wait_preload()
    host = socket.gethostname()
    ip = route_address(controller_addr)
    # lazy: torch-free at import (boot loads torch in a background thread)
    from dpnb.engine.device import device_count, gpu_ids, inherited_visible

    ids = None
    try:
        ids = gpu_ids()  # NVML: CUDA stays uninitialised, so --gpus can still apply
        cuda = device_count()
    except Exception as e:  # a broken accelerator install must not stop a CPU cluster
        log.warning("accelerator not usable on %s: %s: %s", host, type(e).__name__, e)
        cuda = 0
    return {
        "host": host,
        "ip": ip,
        "ifname": interface_of(ip),
        "location": os.environ.get("DPNB_LOCATION", ""),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cuda_devices": cuda,
        "gpu_ids": list(ids) if ids else None,
        "cuda_visible": inherited_visible(),
        "cpu_count": os.cpu_count() or 1,
        "launch_rank": launch_rank(),
    }


def listen_store(addr: str = "127.0.0.1") -> int:
    """Rank 0: open the listening socket of the process group's TCP store.

    Binding it here, to rank 0's own address rather than to every interface,
    keeps a local cluster's store on loopback (torch's TCPStore would
    otherwise listen on all interfaces) and leaves no window in which another
    process could take the port.  :func:`form_group` hands the socket to the
    store; the port goes to the other ranks.
    """
    wait_preload()
    st = get_state(user_ns())
    unused, st.store_sock = st.store_sock, None
    if unused is not None:  # opened for a group that was never formed
        unused.close()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(1024)
    st.store_sock = sock
    return sock.getsockname()[1]


def reach_store(addr: str, port: int, timeout: float = 5.0) -> dict:
    """Can this rank open a TCP connection to the group's store at ``addr:port``?

    Asked of every rank before ``init_process_group`` on multi-host
    clusters: a store nobody can reach would otherwise show up only as
    "timed out, 2/4 clients joined" after the whole group timeout.  The
    connection is closed at once; the store's server drops it.
    """
    t0 = time.monotonic()
    try:
        socket.create_connection((addr, int(port)), timeout=timeout).close()
        return {"ok": True, "host": socket.gethostname(), "s": time.monotonic() - t0}
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        return {"ok": False, "host": socket.gethostname(), "error": f"{why} after "
                f"{time.monotonic() - t0:.1f} s"}


def init_rank(info: dict) -> dict:
    """Give this engine its identity before the group is formed.

    ``info`` carries rank, world_size, local_rank, local_world_size,
    node_rank, backend, device_index (GPU ordinal or None; with
    visible_devices, the CUDA_VISIBLE_DEVICES to show first, and
    device_fallback, the ordinal should CUDA already be initialised), master_addr,
    master_port, timeout_s, threads, watch_ppid, local_cluster, seed (None:
    fresh entropy; see :mod:`dpnb.engine.proc.seeding`).
    """
    wait_preload()
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch
    import torch.distributed as dist


    dpnb_log.install()
    compat.ensure_single_collectives()  # the course and dpnb use torch 2.13's names
    ns = user_ns()
    rank, world = int(info["rank"]), int(info["world_size"])
    worker = torchrun_env(info)
    os.environ.update(worker)
    as_a_worker()  # no interactive prompt, as under torchrun
    # a torchrun script pasted into a cell parses an empty command line, not
    # the engine's own (argparse would refuse its options); %dp run sets its own
    sys.argv[:] = ["cell"]
    # --env KEY=VALUE: set before any group exists, on every launcher
    os.environ.update({str(k): str(v) for k, v in (info.get("env") or {}).items()})
    # compile caches and the side door out of the shared /tmp, in one folder
    # found once (unless the user chose where the caches go: --env)
    from dpnb.engine.proc.private import private_caches, private_dir

    folder = private_dir()
    private_caches(folder)
    if info["backend"] == "nccl" and not info.get("local_cluster"):
        info = dict(info, data_ifname=data_interface(info["master_addr"]))
    for key, value in backend_env(info, folder).items():  # an explicit --env wins
        os.environ.setdefault(key, value)
    # Two engines on two cores each spawning a full intra-op pool oversubscribe
    # the CPU: a DDP step runs about twice as slow as with one thread each.
    torch.set_num_threads(max(1, int(info["threads"])))

    if info["backend"] == "nccl":
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.device import NCCL_DEVICE, set_device, show_gpus

        index = int(info["device_index"])
        if info.get("visible_devices") and not show_gpus(info["visible_devices"]):
            index = int(info["device_fallback"])  # the old numbering still holds
        device = torch.device(NCCL_DEVICE, index)
        set_device(device)
    else:
        device = torch.device("cpu")

    old = ns.get(STATE_NAME)
    state = EngineState(
        rank=rank,
        world_size=world,
        local_rank=int(worker["LOCAL_RANK"]),  # the GPU view the user's code sees
        local_world_size=int(worker["LOCAL_WORLD_SIZE"]),
        node_rank=int(info["node_rank"]),
        backend=info["backend"],
        device=device,
        master_addr=info["master_addr"],
        master_port=int(info["master_port"]),
        timeout_s=float(info["timeout_s"]),
    )
    if old is not None:  # a restart keeps what higher layers registered
        state.carry_from(old)
    state.token = info.get("token")
    ns[STATE_NAME] = state
    ns.update(rank=rank, world_size=world, local_rank=state.local_rank,
              device=device, torch=torch, dist=dist)
    if info.get("watch_ppid"):
        process.watch_parent(int(info["watch_ppid"]))
    process.exit_fast_on_sigterm()
    process.raise_fd_limit(world)  # gloo pairs, the store and the check star grow with N
    process.setup_inline_figures()
    process.forward_display_updates()
    tbtext.install(_shell())  # a failed cell's traceback without IPython's module scans
    outcount.install(_shell().kernel)  # the notebook stops waiting once a cell's output is in
    process.every_request_is_answered(_shell().kernel)  # failed or interrupted cells too
    if info.get("widgets") is False:  # a terminal notebook: no widgets from engines
        process.text_progress_bars()
    door = None
    if info.get("token"):
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.cell import cellguard
        from dpnb.engine.group import lifecycle
        from dpnb.engine.debugging import rankpdb
        from dpnb.engine import sidedoor

        door = sidedoor.open_door(state, info.get("door_addr") or "unix", info["token"],
                                  folder)
        cellguard.install(state)
        lifecycle.install(state)
        rankpdb.install(state)
    if old is None:  # this process's first rank: no user object exists yet
        # its own random numbers, as a fresh torchrun process has (a forked
        # engine starts with its zygote's generators); before any user code
        seeding.seed_rank(rank, info.get("seed"))
        process.freeze_startup_heap()
    return {"rank": rank, "device": str(device), "threads": torch.get_num_threads(),
            "door": door}


def _open_store(st, timeout: timedelta):
    """This formation's rendezvous store: rank 0 serves it on the socket
    :func:`listen_store` bound, every rank connects to it.

    With the cluster's token (always, from the notebook) it is dpnb's
    authenticated store (:mod:`dpnb.engine.group.authstore`): a stranger who reaches
    the port can neither read nor write a key.  Without one (an engine set up
    by hand) it is torch's ``TCPStore``.
    """
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    sock = st.store_sock if st.rank == 0 else None
    mine = sock is not None and sock.getsockname()[1] == st.master_port
    if mine:
        st.store_sock = None
    if st.token:
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.group.authstore import AuthStore, StoreServer

        if mine:
            if st.store_server is not None:  # the last formation's: its groups are gone
                st.store_server.close()
            st.store_server = StoreServer(sock, st.token)
        return AuthStore(st.master_addr, st.master_port, st.token, timeout)
    if mine:
        # the store's server takes ownership of the descriptor and closes it
        # when the group goes away, so Python must let go of it
        return dist.TCPStore(st.master_addr, st.master_port, st.world_size, True,
                             timeout=timeout, master_listen_fd=sock.detach())
    return dist.TCPStore(st.master_addr, st.master_port, st.world_size, False,
                         timeout=timeout)


def form_group(master_port: int | None = None) -> dict:
    """``init_process_group`` for this rank; every rank must call it at once.

    The short timeout is what turns a peer that raised, hung or died into an
    error on the waiting ranks instead of a hang: gloo and NCCL collectives
    give up after it.  A tiny all_reduce checks the group end to end.
    """
    wait_preload()
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch
    import torch.distributed as dist

    ns = user_ns()
    st = get_state(ns)
    if master_port is not None:
        st.master_port = int(master_port)
        os.environ["MASTER_PORT"] = str(master_port)
    kwargs = {}
    if st.backend == "nccl":
        kwargs["device_id"] = st.device
    timeout = timedelta(seconds=st.timeout_s)
    # Joining waits on the store (gloo's rendezvous reads every peer's address
    # from it): bounded by the formation timeout, so a rank that cannot join
    # fails this in about a minute rather than after a 30-minute group timeout.
    store = st.store = _open_store(st, timedelta(seconds=form_timeout(st.timeout_s)))
    # torch's own: a cell's init_process_group is dpnb's adopting one (lifecycle)
    torch_fn("init_process_group")(backend=group_backend(st.backend), store=store, rank=st.rank,
                                   world_size=st.world_size, timeout=timeout, **kwargs)
    # once joined, the store waits as torchrun's does: as long as the group
    # (a new_group whose peers are still busy must not fail sooner)
    store.set_timeout(timeout)
    st.group = dist.group.WORLD  # what a re-formation rebinds from, aborted or not
    t = torch.ones(1, device=st.device)
    dist.all_reduce(t)
    if int(t.item()) != st.world_size:
        raise RuntimeError(f"process group check failed: all_reduce of ones gave {t.item()}")
    st.generation += 1
    if st.cell_guard is not None:  # the connections that check cells' collectives
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.cell.cellguard import form_star

        form_star(st, store)
    start_preload()
    return {"rank": st.rank, "generation": st.generation, "port": st.master_port}


def preload_done() -> bool:
    """Wait for this engine's preload imports (the start waits for this on
    every rank, so its first cell does not)."""
    wait_preload()
    return True


def destroy_group() -> bool:
    """Tear down this rank's process group, tolerating a broken one."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    peer = getattr(user_ns().get(STATE_NAME), "peer", None)
    if peer is not None:  # a peer copy's side thread must not be inside a group destroyed under it
        peer.settle(5.0)
    err = compat.group_error()
    # torch's NCCL watchdog aborted the communicator (a collective outlived the
    # group timeout) and sleeps on in its thread; whoever drops the group's
    # last reference runs ~ProcessGroupNCCL, which joins that thread -- on an
    # H200, torch 2.11, the re-form's cell sat in that join past its bound
    # (benchmarks/gpu_check.py part B; cuda-gdb's stack: Watchdog::join from
    # the pybind dealloc).  So abort (as the side door's release does: c10d's
    # map emptied, nothing shut down) and let a side thread drop the group.
    if err is not None:
        old = dist.group.WORLD
        if compat.abort_groups():
            log.info("the watchdog had aborted the group (%s): aborted, let go off the cell", err)
            retire_group(old)
            return True
    try:
        torch_fn("destroy_process_group")()  # torch's own, not the cells' no-op
    except Exception as e:  # a group whose peer died can fail to shut down cleanly
        log.info("destroy_process_group of a broken group: %s: %s", type(e).__name__, e)
    return True


#: how long a retired group's side thread waits to hold its last reference
RETIRE_WAIT_S = 600.0


def retire_group(pg) -> None:
    """Drop ``pg``'s last reference on a daemon thread, not on the cell's.

    The thread takes a reference, then waits (bounded by :data:`RETIRE_WAIT_S`)
    until it holds the only one -- the re-form's locals gone, the user's
    objects moved to the new group -- and lets go there: a destructor that
    joins torch's watchdog thread blocks nobody's cell.
    """
    if pg is None:
        return

    def hold(box: list) -> None:
        obj = box.pop()  # the Thread's args must not keep a second reference
        deadline = time.monotonic() + RETIRE_WAIT_S
        while sys.getrefcount(obj) > 2 and time.monotonic() < deadline:  # 2: obj + the argument
            time.sleep(0.2)
        del obj

    threading.Thread(target=hold, args=([pg],), daemon=True, name="dpnb-retire-group").start()


def _ranks_agree_on_the_wrap(st: EngineState) -> bool:
    """Whether every rank holds a wrapped model, or none does, agreed on the new
    group (one all_reduce that every rank runs alike, whatever it holds)."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch
    import torch.distributed as dist

    has = 0.0 if st.train is None else 1.0
    t = torch.tensor([has, -has], device=st.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the least, and minus the most
    return bool(t[0].item() == -t[1].item())


def reform_group(master_port: int, callbacks: bool = True) -> dict:
    """Replace a broken process group with a fresh one on ``master_port``.

    Every rank calls this at once.  dpnb's own wrap is re-bound by the
    callbacks the training layer registered in ``EngineState.on_reform``;
    then whatever else the namespace holds on the old group -- under a name
    or inside another object -- is moved (:mod:`dpnb.engine.group.rebind`), and
    ``rebound`` / ``left`` say what was moved and what could not be.  Both
    are collectives (DDP broadcasts parameters), so they run only when every
    rank has its objects: ``callbacks=False`` when some ranks are fresh
    engines that replaced dead ones.
    """
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    ns = user_ns()
    st = get_state(ns)
    # Not dist.group.WORLD alone: an NCCL release aborted the groups, and
    # c10d's world map is empty by now -- the user's objects still hold the
    # group this rank formed last.
    old = dist.group.WORLD if dist.is_initialized() else st.group
    destroy_group()
    out = form_group(master_port)
    problems, moved, left = [], [], []
    if callbacks and not _ranks_agree_on_the_wrap(st):
        # a rank that replaced a dead one (restart without --resume) holds no wrap:
        # a survivor's re-binding alone would broadcast into the new group while
        # that rank runs the next collective -- gloo aborts a size mismatch (SIGABRT,
        # seen: a mistake after such a restart killed the fresh rank).  Nobody
        # re-binds; the survivors' wraps stay on the old group, and their next
        # train says to wrap again or restart --resume.
        callbacks = False
        problems.append("not every rank holds the wrapped model (a rank was replaced without "
                        "--resume): nothing was re-bound; wrap the model again, or %dp restart "
                        "--resume")
    for cb in list(st.on_reform) if callbacks else []:
        try:
            cb(ns, st)
        except Exception as e:  # report, but keep the group: the user can re-wrap
            log.warning("re-binding %s after re-forming failed: %s", cb, e, exc_info=True)
            problems.append(f"{getattr(cb, '__qualname__', cb)}: {type(e).__name__}: {e}")
    if callbacks and old is not None:  # what the user built on the old group (collective)

        try:
            found = rebind_user_objects(ns, old, st.device.type)
            moved, left = found.moved, found.left
        except Exception as e:  # report; the objects stay as they were
            log.warning("re-binding the user's objects failed: %s", e, exc_info=True)
            problems.append(f"your DDP/ZeRO/FSDP objects: {type(e).__name__}: {e}")
    out["problems"] = problems
    out["rebound"] = moved
    out["left"] = left
    return out


