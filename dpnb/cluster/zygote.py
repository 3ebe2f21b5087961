"""The kernel's warm zygote: a template that imported torch once, forking an agent per start.

``%load_ext dpnb`` starts one (where the zygote is the default launcher:
:func:`dpnb.cluster.launch.prewarm_wanted`); every local ``%dp start`` of
that kernel asks it for a zygote agent instead of starting a Python that
imports torch again.  The protocol (one ``socketpair``, three pipe ends per
fork, exits reported by the template) is told in
:mod:`dpnb.engine.template`; here is the kernel's side: the socket's reader
thread, and :class:`ForkedAgentProc`, the part of ``subprocess.Popen``
:class:`~dpnb.cluster.agents.HostAgent` uses, for an agent that is this
kernel's grandchild.

Measured here (2 cores): the imports cost about 5.6 CPU-seconds
(``/usr/bin/time``); three 2-rank starts from one template took 2.5, 2.1
and 2.1 s to a ready group, a cold ``dpnb.start(2)`` 4.5 s.  Before the
template, ``%load_ext`` started a zygote that the first start *took*, and
every ``%dp stop`` started (and paid for) the next one.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import subprocess
import sys
import threading

from ..errors import StartError
from dpnb.engine import entrypoints as ep
from dpnb.engine import template

from .agents import REPLY_TIMEOUT_S, ZYGOTE_HOST, ZYGOTE_IMPORT_S, HostAgent, import_time_env
from .processes import same_process, start_time

log = logging.getLogger(__name__)


class WarmZygote:
    """A template that imported torch ahead of the kernel's local starts.

    It imports while the user writes the next cell; each start then forks
    its agent from it (:meth:`take`).  It is one idle process of this kernel
    between starts: it ends with the kernel (its stdin is the kernel's
    socket) or at :meth:`close`.  Its agents' engines get the kernel's
    environment of start time (sent with ``hello``); a start does not use it
    if a variable read while importing torch changed since it started."""

    def __init__(self, command: list[str] | None = None):
        """``command``: the template's (default: the host agent's ``--template``)."""
        self.env = import_time_env()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                command or [sys.executable, "-m", ep.HOSTAGENT_MODULE, template.FLAG],
                stdin=theirs,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.err: collections.deque[str] = collections.deque(maxlen=40)
        self._cv = threading.Condition()
        self._ready = False
        self._pids: collections.deque[int | str] = collections.deque()  # fork replies, in order
        self._exits: dict[int, int] = {}  # an agent's pid -> its exit code
        self._ended = False  # the socket ended: the template is gone
        self._fork_lock = threading.Lock()  # one fork request and its reply at a time
        threading.Thread(target=self._read, name="dpnb-template", daemon=True).start()
        threading.Thread(target=self._read_err, name="dpnb-template-err", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None else None

    # ---------------------------------------------------------------- reading
    def _read(self) -> None:
        with self.sock.makefile("r") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("zygote template: unreadable line %r", line[:200])
                    continue
                with self._cv:
                    if "exit" in msg:
                        self._exits[int(msg["exit"])] = int(msg["code"])
                    elif "pid" in msg:
                        self._pids.append(int(msg["pid"]))
                    elif "error" in msg:
                        self._pids.append(str(msg["error"]))
                    elif msg.get("ready"):
                        self._ready = True
                    self._cv.notify_all()
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # import failures, said by the template itself
            self.err.append(line.rstrip())
            log.info("zygote template: %s", line.rstrip())

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the template has imported everything (it says so only then)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._ready or self._ended, timeout) and self._ready

    def usable(self) -> bool:
        """Running, and started with the import-time environment the kernel has now."""
        return not self._ended and self.proc.poll() is None and import_time_env() == self.env

    # ---------------------------------------------------------------- forking
    def take(self) -> HostAgent | None:
        """A fresh zygote agent forked from the template, or None (said in the
        log) when the template is gone or imported under another environment."""
        if not self.usable():
            log.info("warm zygote not used (%s)", "it ended" if self.proc.poll() is not None
                     or self._ended else "the environment changed since it started")
            return None
        pipes = [os.pipe() for _ in range(3)]  # (read, write): stdin, stdout, stderr
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:
            with self._fork_lock:
                socket.send_fds(self.sock, [b'{"cmd": "fork"}\n'], theirs)
                pid = self._reply(REPLY_TIMEOUT_S + ZYGOTE_IMPORT_S)
        except (OSError, StartError) as e:
            for fd in ours:
                os.close(fd)
            log.warning("warm zygote could not fork an agent: %s", e)
            return None
        finally:
            for fd in theirs:
                os.close(fd)
        proc = ForkedAgentProc(pid, self, os.fdopen(ours[0], "w", buffering=1),
                               os.fdopen(ours[1], "r"), os.fdopen(ours[2], "r"))
        return HostAgent(ZYGOTE_HOST, [sys.executable, "-m", ep.HOSTAGENT_MODULE,
                                       f"(forked from the template, pid {self.proc.pid})"],
                         proc=proc)

    def _reply(self, timeout: float) -> int:
        with self._cv:
            if not self._cv.wait_for(lambda: self._pids or self._ended, timeout):
                raise StartError(f"the zygote template (pid {self.proc.pid}) did not fork an "
                                 f"agent within {timeout:.0f} s")
            if not self._pids:
                raise StartError(f"the zygote template (pid {self.proc.pid}) ended"
                                 + (f"; its stderr ended with:\n" + "\n".join(self.err)
                                    if self.err else ""))
            got = self._pids.popleft()
        if isinstance(got, str):
            raise StartError(f"the zygote template refused to fork: {got}")
        return got

    def exit_code(self, pid: int) -> int | None:
        with self._cv:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cv:
            self._cv.wait_for(lambda: pid in self._exits or self._ended, timeout)
            return self._exits.get(pid)

    def ended(self) -> bool:
        with self._cv:
            return self._ended

    def close(self) -> None:
        """End the template (its agents are not its: each ends with its own cluster)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError as e:  # already gone
            log.debug("zygote template socket: %s", e)
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # still importing: our own child, by its Popen handle
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.sock.close()


class ForkedAgentProc:
    """The part of ``subprocess.Popen`` :class:`HostAgent` uses, for an agent the
    template forked: this kernel's grandchild, so its exit code comes from
    the template; if the template itself is gone, the PID and its start time
    say whether the agent still runs (its code is then unknown: 255)."""

    UNKNOWN = 255

    def __init__(self, pid: int, template: WarmZygote, stdin, stdout, stderr):
        self.pid, self.template = pid, template
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.started = start_time(pid)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self.template.exit_code(self.pid)
        if code is not None:
            return code
        if self.template.ended() and not same_process(self.pid, self.started):
            return self.UNKNOWN
        return None

    def wait(self, timeout: float | None = None) -> int:
        code = self.template.wait_exit(self.pid, timeout)
        if code is None:
            code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"agent pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # ended meanwhile: its exit is reported by the template

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

