"""The zygote template: torch imported once per kernel, a zygote agent forked per start.

``python -m dpnb.engine.hostagent --template``, started by the kernel
(:class:`dpnb.cluster.zygote.WarmZygote`) at ``%load_ext dpnb`` and kept
until the extension unloads or the kernel ends.  It imports what every
engine would (``hostagent.zygote_imports``), then waits.  Each local start
sends it, over its stdin -- a UNIX socket, the kernel's end of a
``socketpair`` -- one line ``{"cmd": "fork"}`` carrying three file
descriptors (``SCM_RIGHTS``): the read end of the new agent's stdin pipe and
the write ends of its stdout and stderr pipes.  The template forks; the child
puts them on 0, 1 and 2 and is from then on an ordinary zygote agent
(:class:`dpnb.engine.hostagent.Agent`) speaking JSON lines with the kernel,
which forks that start's engines.  The template answers ``{"pid": P}``.

Who talks: only the kernel and the template, on that socket; nothing of a
cluster goes through it.  Why: the torch import (about 5.5 CPU-seconds
here, with DDP's and FSDP's modules) is paid once per kernel, not once per
``%dp start``, and the agent is still this kernel's descendant, so a failed
start finds and stops it as it does any process it spawned
(:class:`dpnb.cluster.processes.Spawned`).

The kernel cannot ``waitpid`` a grandchild, so the template reaps its
children and reports each exit: ``{"exit": P, "code": C}`` (C as Popen's
``returncode``: ``-N`` for signal N).  End of input -- the kernel closed the
socket or died -- ends the template; the agents it forked end on their own
stdin's end, as every agent does.

It stays single-threaded: a fork copies only the calling thread, so a lock
another thread held at that moment would stay held in the child forever.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys

#: the host agent's flag that makes it a template (``python -m dpnb.engine.hostagent --template``)
FLAG = "--template"

#: how often the template looks for children that ended (their exits reach
#: the kernel at most this late; the agents' own engines are reported by the
#: agents at once)
REAP_EVERY_S = 0.2


def serve(sock: socket.socket, become_agent) -> None:
    """Fork an agent per request on ``sock`` until it ends; ``become_agent(stdin)``
    runs in each child with its pipes on 0-2 and never returns."""
    _send(sock, {"ready": True})
    while True:
        _reap(sock)
        readable, _, _ = select.select([sock], [], [], REAP_EVERY_S)
        if not readable:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 3)
        except OSError:
            return
        if not msg:
            return  # the kernel closed its end, or is gone
        if len(fds) != 3 or json.loads(msg).get("cmd") != "fork":
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": "expected one fork request with three descriptors"})
            continue
        pid = os.fork()
        if pid == 0:
            _child(sock, fds, become_agent)
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})


def _child(sock: socket.socket, fds: list[int], become_agent) -> None:
    try:
        os.setsid()  # as Popen(start_new_session=True): the kernel's signals are its own
        sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        become_agent(os.fdopen(0, "r"))
    finally:
        os._exit(1)  # become_agent exits itself; reaching here is a failure


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.sendall((json.dumps(msg) + "\n").encode())
    except OSError as e:  # the kernel is gone: the next read sees the end and returns
        print(f"dpnb template: could not send {msg}: {e}", file=sys.stderr)
