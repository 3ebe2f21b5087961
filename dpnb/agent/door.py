"""The holder's door: how ``dpnb mcp`` reaches a cluster that a notebook holds.

A cluster has one holder -- the kernel that started it (or attached it), or
``dpnb mcp`` itself for a kept cluster no kernel holds -- and only the holder
may drive it: its ipyparallel client, its turn, its records of the last
failed cell and the running training live there.  So the holder opens a
door: a Unix socket in the user's private folder (0700; the socket 0600),
served by a daemon thread, whose every connection is checked to come from
a process of the same user (``SO_PEERCRED``) before a byte of it is read.
Its path is in the cluster's publication (:mod:`dpnb.cluster.publish`), where
``dpnb mcp`` finds it.

The protocol is one request per connection, JSON lines:

* the agent's server sends ``{"tool": NAME, "args": {...}}``;
* the holder answers, on the door's thread and beside whatever the notebook
  does (:class:`~.service.AgentService` says how), zero or more
  ``{"progress": {...}}`` lines (a running ``run_code``: each rank's where-line
  every second), then one ``{"result": ...}``, ``{"refused": TEXT}`` or
  ``{"error": TEXT, "report": TEXT}``;
* a connection the agent closes before its answer cancels it: a ``run_code``
  interrupts the ranks it started.

Each connection has a thread of its own, so ``where`` and ``interrupt`` are
answered while a ``run_code`` (or the human's cell) runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import socketserver
import struct
import threading

from ..core.errors import UserError
from dpnb.engine.proc.private import private_dir
from .service import AgentService, AgentRefused

log = logging.getLogger(__name__)

#: the longest request line read (a run_code's cell included)
MAX_REQUEST = 4 * 2**20
#: the longest answer line read back
MAX_ANSWER = 64 * 2**20


def door_path(cluster_id: str) -> str:
    """Where the holder of ``cluster_id`` listens (the user's private folder)."""
    return os.path.join(private_dir(), f"agent-{cluster_id}.sock")


def _peer(sock) -> tuple[int, int]:
    """The connecting process's PID and user id, as the kernel tells them."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return pid, uid


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        pid, uid = _peer(self.request)
        if uid != os.getuid():  # the folder is 0700 already: a second lock, never reached
            log.warning("agent door of %s: refused a connection from uid %s (pid %s)",
                        self.server.door.cluster_id, uid, pid)
            return
        try:
            req = json.loads(self.rfile.readline(MAX_REQUEST))
            tool, args = str(req["tool"]), dict(req.get("args") or {})
        except (ValueError, KeyError, TypeError) as e:
            self._send({"error": f"bad request: {type(e).__name__}: {e}", "report": ""})
            return
        try:
            out = self.server.door.service.answer(tool, args, pid, on_progress=self._progress,
                                                  cancelled=self._gone)
            self._send({"result": out})
        except AgentRefused as e:
            self._send({"refused": str(e)})
        except UserError as e:  # a failed cell, a refusing state: dpnb's words
            self._send({"error": str(e), "report": getattr(e, "report", "") or ""})
        except Exception as e:  # the agent gets the cause; the log keeps the trace
            log.warning("agent door: %s failed: %s: %s", tool, type(e).__name__, e, exc_info=True)
            self._send({"error": f"{type(e).__name__}: {e}", "report": ""})

    def _send(self, msg: dict) -> None:
        try:
            self.wfile.write((json.dumps(msg, default=str) + "\n").encode())
            self.wfile.flush()
        except OSError as e:  # the agent went away: nobody to answer
            log.info("agent door: answer not delivered (%s)", e)

    def _progress(self, data: dict) -> None:
        # raises OSError when the agent is gone: the service takes it as a cancellation
        self.wfile.write((json.dumps({"progress": data}, default=str) + "\n").encode())
        self.wfile.flush()

    def _gone(self) -> bool:
        """The agent closed its end (cancelled): readable with nothing to read."""
        ready, _, _ = select.select([self.request], [], [], 0)
        if not ready:
            return False
        try:
            return self.request.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class Door:
    """The door of cluster ``c`` (a :class:`dpnb.Cluster`), open until :meth:`close`."""

    def __init__(self, c):
        self.cluster_id = c.cluster_id
        self.service = AgentService(c)
        self.path = door_path(c.cluster_id)
        try:
            os.unlink(self.path)  # a door left by a holder that died: ours now
        except FileNotFoundError:
            pass
        old = os.umask(0o177)  # the socket is created 0600, never briefly open
        try:
            self._server = _Server(self.path, _Handler)
        finally:
            os.umask(old)
        self._server.door = self
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.5,),
                                        name=f"dpnb-agent-door-{c.cluster_id}", daemon=True)
        self._thread.start()

    def summary(self) -> dict:
        """What is published for the sidebar: the grant, agents seen, recent actions."""
        return self.service.summary()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.service.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def open_door(c) -> Door | None:
    """Open ``c``'s door (once); a failure is logged and leaves the cluster without one."""
    if getattr(c, "agent_door", None) is not None:
        return c.agent_door
    try:
        c.agent_door = Door(c)
    except OSError as e:
        log.warning("no agent door for cluster %s (dpnb mcp cannot see it): %s: %s",
                    c.cluster_id, type(e).__name__, e)
        return None
    if c.published is not None:
        c.published.write()  # published now, not a second later: dpnb mcp looks for it there
    return c.agent_door


# ------------------------------------------------------------- the agent's side
class DoorError(UserError):
    """The holder answered with an error, or could not be reached."""

    def __init__(self, message: str, report: str = "", refused: bool = False):
        super().__init__(message)
        self.report, self.refused = report, refused


async def ask(path: str, tool: str, args: dict, on_progress=None) -> dict:
    """``tool(**args)`` answered by the holder behind the door at ``path``; progress
    lines go to ``await on_progress(dict)``.  Cancelling this (the agent's request was
    cancelled) closes the connection, which cancels the call there."""
    try:
        reader, writer = await asyncio.open_unix_connection(path, limit=MAX_ANSWER)
    except OSError as e:
        raise DoorError(f"the cluster's holder does not answer at {path} ({e}): its kernel "
                        f"may have ended; dpnb mcp lists the clusters it can serve") from e
    try:
        writer.write((json.dumps({"tool": tool, "args": args}) + "\n").encode())
        await writer.drain()
        while True:
            line = await reader.readline()
            if not line:
                raise DoorError(f"the cluster's holder closed the door during {tool} (its "
                                f"kernel may have ended)")
            msg = json.loads(line)
            if "progress" in msg:
                if on_progress is not None:
                    await on_progress(msg["progress"])
                continue
            if "result" in msg:
                return msg["result"]
            if "refused" in msg:
                raise DoorError(msg["refused"], refused=True)
            raise DoorError(msg.get("error") or "no answer", msg.get("report") or "")
    finally:
        writer.close()
