"""One agent per cluster per host: its record there, and superseding a stale one.

An ssh agent lives as long as its connection to the notebook.  When the link
is cut, the notebook's ssh client notices within about 15 s
(``ServerAliveInterval``) and the ranks of that host are named dead; the
host's sshd may not notice for hours (no client-alive probe by default), so
the old agent and its engines -- holding a broken group, memory, a GPU --
keep running there.  When the notebook reaches the host again (``%dp
restart``), the new agent's ``hello`` names the cluster; a record of the
same cluster left by another agent that still runs is stale by construction
-- the notebook opens a second agent on a host only after the first one's
connection ended -- so the new agent ends that agent's engines and the
agent itself, each by PID and start time, before it starts any engine.

Records are files in a per-user folder (mode 0700, refused if another user
owns it): ``<cluster>.<host>.<pid>`` -- the host name too, for hosts that
share one /tmp (network-namespace hosts, as in dpnb's tests: two hosts'
agents can hold the same PID, each in its own PID namespace) -- a JSON
``{"agent": [pid, start], "engines": [[pid, start], ...]}``, rewritten when
the agent starts engines and removed when it exits.  Standard library only: the agent imports no torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import tempfile


def folder() -> str | None:
    """This user's records folder, made if missing; None if it is not safely ours."""
    path = os.path.join(tempfile.gettempdir(), f"dpnb-agents-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        print(f"dpnb agent: no record folder ({e})", file=sys.stderr)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        print(f"dpnb agent: {path} is not a private folder of this user; no records kept",
              file=sys.stderr)
        return None
    return path


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the first is field 3, the
    state); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


class Record:
    """This agent's record for ``cluster`` (nothing is written where no folder is)."""

    def __init__(self, cluster: str):
        self.cluster = cluster
        self.dir = folder()
        self.prefix = f"{_safe(cluster)}.{_safe(socket.gethostname())}."
        self.path = os.path.join(self.dir, f"{self.prefix}{os.getpid()}") if self.dir else None
        self.me = [os.getpid(), start_time(os.getpid())]

    def write(self, engines: list[int]) -> None:
        if self.path is None:
            return
        body = {"agent": self.me, "engines": [[p, start_time(p)] for p in engines]}
        tmp = self.path + ".tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def supersede(self) -> list[int]:
        """End every other agent of this cluster on this host, and its engines:
        SIGKILL by PID where the start time still matches.  The PIDs ended."""
        if self.dir is None:
            return []
        ended = []
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if not name.startswith(self.prefix) or name.endswith(".tmp") or path == self.path:
                continue
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError) as e:
                print(f"dpnb agent: unreadable record {name}: {e}", file=sys.stderr)
                continue
            for pid, started in [*rec.get("engines", []), rec.get("agent", [None, None])]:
                if pid is not None and started is not None and start_time(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        ended.append(pid)
                    except ProcessLookupError:
                        pass
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return ended


def _safe(cluster: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in cluster)[:80]
