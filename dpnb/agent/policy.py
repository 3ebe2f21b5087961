"""What an agent may do through ``dpnb mcp``, how much it reads back, and the trail it leaves.

Pure: no MCP, no torch, no cluster.  The server (:mod:`dpnb.agent.server`)
asks :func:`refusal` before every tool call -- a refused call touches
nothing on the ranks -- caps every result with :func:`cap` before it goes
back over the wire (a rank that prints 10 MB must not flood the agent's
context), and appends one :func:`audit_record` per call, refused ones too,
to a file only this user can read (:func:`append_audit`).
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from enum import Enum

#: characters any one string of a result may keep (head and tail of longer ones)
TEXT_CAP = 20_000
#: characters a whole result may take as JSON before its longest strings are cut further
RESULT_CAP = 100_000
#: characters of a call's arguments (a cell's code) the audit log keeps
AUDIT_ARG_CAP = 2_000


class Need(str, Enum):
    """What a tool needs besides attaching: nothing, ``--allow-actions``, ``--allow-code``."""

    READ = "read"
    ACTIONS = "actions"
    CODE = "code"


#: the command-line flag that grants each need
FLAG = {Need.ACTIONS: "--allow-actions", Need.CODE: "--allow-code"}


@dataclass(frozen=True)
class Permissions:
    """What this server was started to allow (read-only tools always are)."""

    actions: bool = False
    code: bool = False

    def allows(self, need: Need) -> bool:
        return need == Need.READ or (need == Need.ACTIONS and self.actions) or \
            (need == Need.CODE and self.code)


def refusal(tool: str, need: Need, perms: Permissions) -> str | None:
    """``None`` when ``perms`` allow ``tool``; else the one line the agent reads."""
    if perms.allows(need):
        return None
    what = "changes the cluster" if need == Need.ACTIONS else "runs code on the ranks"
    return (f"refused: {tool} {what}, and this dpnb mcp server was started without "
            f"{FLAG[need]}; nothing was done (restart the server with {FLAG[need]} to allow it)")


def cap_text(text: str, limit: int = TEXT_CAP) -> str:
    """``text`` if it is at most ``limit`` characters, else its head and tail around a
    line that says how much was cut (the end of an output is where errors are)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut: output capped at {limit} ...]\n{text[-tail:]}"


def _cap_all(value, limit: int):
    if isinstance(value, str):
        return cap_text(value, limit)
    if isinstance(value, dict):
        return {str(k): _cap_all(v, limit) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cap_all(v, limit) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return cap_text(str(value), limit)  # anything else travels as its text


def cap(result: dict, text_cap: int = TEXT_CAP, total_cap: int = RESULT_CAP) -> dict:
    """``result`` as plain JSON values, every string at most ``text_cap`` characters,
    and the whole at most about ``total_cap`` characters of JSON (strings cut
    harder until it fits; ``capped`` says so)."""
    out = _cap_all(result, text_cap)
    limit = text_cap
    while len(json.dumps(out)) > total_cap and limit > 200:
        limit //= 2
        out = _cap_all(result, limit)
    if limit != text_cap or out != _cap_all(result, 10 ** 12):
        out["capped"] = f"strings cut to at most {limit} characters"
    return out


def audit_record(tool: str, args: dict, *, allowed: bool, outcome: str, seconds: float,
                 cluster_id: str) -> dict:
    """One line of the audit log: when, which cluster, which tool with which
    arguments (long ones cut), whether it was allowed, how it ended."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cluster": cluster_id,
            "server_pid": os.getpid(), "tool": tool,
            "args": _cap_all(args, AUDIT_ARG_CAP), "allowed": allowed,
            "outcome": cap_text(outcome, AUDIT_ARG_CAP), "seconds": round(seconds, 3)}


def audit_path(folder: str, cluster_id: str) -> str:
    """The audit log of ``cluster_id`` in ``folder`` (the user's private folder)."""
    return os.path.join(folder, f"mcp-audit-{cluster_id}.jsonl")


def append_audit(path: str, record: dict) -> None:
    """Append ``record`` as one JSON line; the file is created 0600 and must be this
    user's own regular file (a planted link or another user's file is refused)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} is not this user's private file: not writing the "
                                  f"audit log there")
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())
    finally:
        os.close(fd)
