"""A side door into a busy engine: release its process group, or say where it is stuck.

A rank whose main thread is blocked inside a gloo collective ignores SIGINT
and the ipyparallel queue; what frees it is its peers' connections closing
("Connection closed by peer", within milliseconds).  Measured with torch 2.13
on 2 gloo ranks both blocked (one in ``all_reduce``, one in ``recv``):
``destroy_process_group``, ``_abort_process_group`` or ``ProcessGroup.abort``
called from another thread of the blocked process released nothing until the
20 s group timeout (``abort`` even made the peer SIGABRT), while
``shutdown(SHUT_RDWR)`` of the group's TCP connections from another thread
released both ranks 10 ms later, and a new group formed at once.

So every engine runs one daemon thread, the side door, listening on a UNIX
socket in its owner's private folder (local clusters) or a port of its own
address (multi-host).  The notebook proves it holds the cluster's token
(:mod:`dpnb.engine.proc.wire`) and sends one command:

``release``
    shut down every TCP connection this process opened since its first
    ``init_rank`` (the process groups' gloo pairs and store connections --
    not ipyparallel's, which were open before); every collective on this rank
    and on its peers fails at once; the notebook then re-forms the group.
``dap``
    a request of JupyterLab's debugger for this rank (a stop's stack,
    variables, continue...): :mod:`dpnb.engine.debugging.rankdap`.
``where``
    what the main thread is doing: the user's cell line, and the collective
    it is inside (op, shape, dtype, its number in this cell), read from the
    main thread's frame (``sys._current_frames``) -- no ptrace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import sys
import threading
from typing import Any

import psutil

from dpnb.engine.debugging import frames, rankdap, rankpdb
from dpnb.engine.proc import wire
from dpnb.engine.cell.collcheck import COLLECTIVES, DEVICE_WAIT_OP, DEVICE_WAITS
from dpnb.engine.proc.private import private_dir

log = logging.getLogger(__name__)

def tcp_connections() -> set[tuple]:
    """``(local, remote)`` address pairs of this process's established TCP connections."""
    out = set()
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr:
            out.add((tuple(c.laddr), tuple(c.raddr)))
    return out


def release_connections(keep: set[tuple], also_keep: tuple | None = None) -> int:
    """Shut down (both directions) every established TCP connection not in
    ``keep`` (nor ``also_keep``, the connection asking for it)."""
    n = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        pair = (tuple(c.laddr), tuple(c.raddr))
        if pair in keep or pair == also_keep:
            continue
        try:
            s = socket.socket(fileno=c.fd)
        except OSError as e:  # gloo closed it meanwhile (its peer went first)
            log.debug("connection %s -> %s already closed: %s", c.laddr, c.raddr, e)
            continue
        try:
            # the descriptor may have been reused since the listing: check it
            if (s.getsockname()[:2], s.getpeername()[:2]) == (tuple(c.laddr), tuple(c.raddr)):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError as e:  # closed meanwhile: nothing left to release
            log.debug("shutdown of %s -> %s: %s", c.laddr, c.raddr, e)
        finally:
            s.detach()  # the descriptor stays the group's; only the connection ends
    return n


_TENSOR_ARGS = ("tensor", "output_tensor", "output", "input_tensor", "input", "tensor_list")


def _describe_args(out: dict, args: dict) -> None:
    for key in _TENSOR_ARGS:
        t = args.get(key)
        if isinstance(t, (list, tuple)) and t:
            t = t[0]
        if t is not None and hasattr(t, "shape"):
            out.update(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            return


def _group_ranks(group) -> list[int] | None:
    """The global ranks of ``group``; None for the default (world) group."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return None
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception as e:  # a destroyed or foreign group: treat it as unknown
        log.debug("ranks of group %r: %s", group, e)
        return []


def _collective_frame(frame) -> dict | None:
    """The torch.distributed collective the stack is inside (outermost c10d API
    frame), for calls made outside a cell (the cell guard notes its own)."""
    hit = None
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py") \
                and code.co_name in COLLECTIVES:
            hit = f
        f = f.f_back
    if hit is None:
        return None
    loc = hit.f_locals
    out: dict[str, Any] = {"op": hit.f_code.co_name, "group": _group_ranks(loc.get("group"))}
    _describe_args(out, loc)
    return out


def _device_wait(state, frame) -> dict | None:
    """The NCCL rank's wait for its GPU's queued work, as a collective the
    diagnosis can reason about (its group unknown: taken as the world) --
    only while a collective dpnb saw issued on this rank has not completed
    (``state.collective_mark``).  Queued work alone is no collective: a rank
    synchronizing behind its own matmuls is running, and calling it a
    certain deadlock would abort every rank's communicators."""
    if getattr(state, "backend", None) != "nccl" or frame is None:
        return None
    path = frame.f_code.co_filename.replace("\\", "/")
    if frame.f_code.co_name not in DEVICE_WAITS or not ("/torch/" in path or
                                                        path.endswith("dpnb/engine/device.py")):
        return None
    # lazy: torch-free at import (boot loads torch in a background thread)
    from dpnb.engine import device

    if not device.collective_pending(getattr(state, "collective_mark", None)):
        return None
    return {"op": DEVICE_WAIT_OP, "group": None, "device_wait": True}


def _current(state) -> dict | None:
    """The collective the cell guard noted for the main thread, made plain."""
    cur = getattr(state, "current_collective", None)
    if not cur:
        return None
    out = {"op": cur["op"], "seq": cur.get("seq"), "phase": cur.get("phase", "run"),
           "group": _group_ranks(cur.get("group")), "peer": cur.get("peer"),
           "index": cur.get("index")}
    awaiting = cur.get("awaiting")
    if out["phase"] == "check" and awaiting is not None:
        out["awaiting"] = awaiting()
    _describe_args(out, cur.get("tensor") or {})
    return out


def where(state, ident: int | None = None) -> dict:
    """What the main thread (or thread ``ident``) is doing now (safe from any thread)."""
    frame = sys._current_frames().get(ident or threading.main_thread().ident)
    cell = frames.cell_frame(frame) if frame is not None else None
    user = frames.user_frame(frame) if frame is not None else None
    coll = _current(state) or (_collective_frame(frame) if frame is not None else None) \
        or _device_wait(state, frame)
    dbg = getattr(state, "debugger", None)
    return {
        "rank": getattr(state, "rank", None),
        "busy": frame is not None and _busy(frame),
        "cell_line": cell[1] if cell else None,
        "in_cell": cell is not None,
        "user_line": user[2] if user else None,
        "inside": frames.library_below(frame, user[0]) if user else "",
        "collective": coll,
        "reporting": frame is not None and _reporting(frame),
        "debugger": dbg.where() if dbg is not None else None,
        "cell_calls": dict(getattr(state, "cell_calls", None) or {}),
        "top": f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:"
               f"{frame.f_lineno})" if frame is not None else None,
    }


#: IPython functions that format a cell's error: a rank inside one has already
#: failed and is only writing its report (slow under load: stack_data
#: highlights every frame), neither a culprit nor waiting on a peer
_REPORTING = frozenset({"showtraceback", "structured_traceback", "_showtraceback",
                        "format_exception_as_a_whole"})


def _reporting(frame) -> bool:
    f = frame
    while f is not None:
        if f.f_code.co_name in _REPORTING and "IPython" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _busy(frame) -> bool:
    """False when the main thread only waits for the next request (ipykernel's loop)."""
    f = frame
    while f is not None:
        if f.f_code.co_name in ("run_cell", "run_cell_async", "do_apply", "apply_request",
                                "run_code", "execute_request"):
            return True
        f = f.f_back
    return False


#: a request is one small JSON object (a pdb line at most); larger is refused
MAX_REQUEST = 64 << 10


class SideDoor:
    """The door of one engine process: an authenticated listener in its own thread.

    Local clusters listen on a UNIX socket in the owner's private folder
    (:func:`dpnb.engine.proc.private.private_dir`, mode 0700): no other user can
    even connect.  Multi-host clusters listen on the rank's address, where the
    handshake of :mod:`dpnb.engine.proc.wire` turns strangers away within a
    deadline and without delaying anyone else.
    """

    def __init__(self, state, addr: str, token: str, keep: set[tuple],
                 folder: str | None = None):
        self.state, self.keep = state, keep
        if addr == "unix":
            if folder is None:
                folder = private_dir()
            _prune_doors(folder)
            path = os.path.join(folder, f"door-{os.getpid()}-{secrets.token_hex(4)}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o600)
            self.address = (path, 0)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET,
                                 socket.SOCK_STREAM)
            sock.bind((addr, 0))
            self.address = (addr, sock.getsockname()[1])
        sock.listen(64)
        self.server = wire.Server("dpnb-side-door", sock, token, self._serve)

    @property
    def token(self) -> str:
        return self.server.token

    @token.setter
    def token(self, value: str) -> None:
        self.server.token = value

    def start(self) -> None:
        self.server.start()

    def is_alive(self) -> bool:
        return self.server.is_alive()

    def close(self) -> None:
        self.server.close()
        if self.address[0].startswith("/"):
            try:
                os.unlink(self.address[0])
            except OSError as e:
                log.debug("side door socket %s: %s", self.address[0], e)

    async def _serve(self, reader, writer) -> None:
        """One request, one answer; the connection then ends."""
        data = await wire.read_frame(reader, MAX_REQUEST)
        if data is None:
            return
        try:
            req = json.loads(data)
            args = (req, writer.get_extra_info("sockname"), writer.get_extra_info("peername"))
            # a debugger request waits for the stopped main thread: not on this loop,
            # which must stay free to release the group meanwhile
            out = (await asyncio.to_thread(self.answer, *args) if req.get("cmd") == "dap"
                   else self.answer(*args))
        except Exception as e:  # one bad request must not close the door
            log.warning("side door request failed: %s: %s", type(e).__name__, e, exc_info=True)
            out = {"error": f"{type(e).__name__}: {e}"}
        writer.write(wire.frame(json.dumps(out, default=str).encode()))
        await writer.drain()

    def release(self, sockname, peername) -> dict:
        """Fail every collective of this process at once (see the module docstring).

        Counted first, so a training step that was inside its gradient sync
        refuses its optimizer step (:func:`dpnb.engine.train.step.optimizer_gate`).
        Under NCCL the communicators are aborted *before* the sockets shut:
        NCCL's watchdog must not see a broken connection before its abort
        flag is set (it would tear the process down).
        """
        self.state.releases = getattr(self.state, "releases", 0) + 1
        out: dict = {}
        if getattr(self.state, "backend", None) == "nccl":
            # NCCL waits on the GPU, not on a socket: abort its communicators
            # (NCCL's abort is made to be called from another thread)
            from dpnb import compat

            out["aborted"] = compat.abort_groups()
        # the asking connection itself must survive the release
        me = (tuple(sockname[:2]), tuple(peername[:2])) \
            if isinstance(sockname, tuple) and isinstance(peername, tuple) else None
        out["released"] = release_connections(self.keep, me)
        log.info("released %d group connections", out["released"])
        return out

    def answer(self, req: dict, sockname, peername) -> dict:
        cmd = req.get("cmd")
        if cmd == "release":
            return self.release(sockname, peername)
        if cmd == "where":
            return where(self.state)
        if cmd == "pdb":  # a line for this rank's debugger (None: go on without it)
            return {"fed": rankpdb.feed(self.state, req.get("line"))}
        if cmd == "dap":  # JupyterLab's debugger, through the notebook's router
            return rankdap.request(self.state, req.get("req") or {})
        return {"error": f"unknown command {cmd!r}"}


def _prune_doors(folder: str) -> None:
    """Remove the sockets of this user's engines that are gone (an engine
    killed, or ended by ``os._exit``, leaves its socket file behind)."""
    for name in os.listdir(folder):
        if not name.startswith("door-"):
            continue
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):  # not a door's name: not ours to remove
            continue
        if not psutil.pid_exists(pid):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError as e:  # another engine pruned it first
                log.debug("stale side door %s: %s", name, e)


def open_door(state, addr: str, token: str, folder: str | None = None) -> tuple[str, int]:
    """Start this engine's side door once (later calls update the token); return
    its address: ``(path, 0)`` for a UNIX socket in ``folder`` (the owner's
    private folder; ``addr == "unix"``), else ``(addr, port)``."""
    door = getattr(state, "side_door", None)
    if door is None or not door.is_alive():
        keep = tcp_connections()  # ipyparallel's own connections: never released
        door = SideDoor(state, addr, token, keep, folder)
        door.start()
        state.side_door = door
    door.token = token
    door.state = state
    return door.address
