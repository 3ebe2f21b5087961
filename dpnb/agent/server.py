"""``dpnb mcp``: a Model Context Protocol server over a kept dpnb cluster.

The server is one process between an agent and the cluster: it attaches
to a cluster a kernel left running with ``--keep`` (it then holds it, as a
kernel would; at exit it lets go, and the cluster stays for the next
kernel or agent), speaks MCP over stdio with the agent, and drives the
ranks through the same ``Cluster`` a notebook uses -- ipyparallel for calls,
the side doors for ``where``.  One call at a time reaches the cluster (the
SDK runs each tool on a worker thread; a lock keeps them in line, as a
notebook's cells are).

Read-only tools are always served.  Actions (``interrupt``, ``restart``,
``reform``, ``save``) need ``--allow-actions``, ``run_code`` needs
``--allow-code``; every tool is listed either way, so that a refusal can
name its flag.  Every call, refused or not, is appended to the audit log
(:func:`audit_file`), and every answer is capped (:mod:`.policy`).
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
import time
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from ..cluster import keep
from ..core.errors import UserError
from dpnb.engine.proc.private import private_dir
from ..errors import DpnbError
from ..session import Cluster
from . import policy, tools
from .policy import Need, Permissions

log = logging.getLogger(__name__)

READ = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
ACT = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)
CODE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False,
                       open_world_hint=True)
#: the longest a run_code cell may be given (seconds)
MAX_CODE_TIMEOUT_S = 600.0

INSTRUCTIONS = ("Tools over a live dpnb cluster: PyTorch ranks joined in one torch.distributed "
                "group. Start with status; when a cell hangs or fails, where and last_error say "
                "which rank, which collective and which line. Actions and run_code are refused "
                "unless the server was started with --allow-actions / --allow-code.")


def audit_file(cluster_id: str) -> str:
    """Where this cluster's MCP calls are logged: the user's private folder (0700),
    which outlives the cluster's own profile folder."""
    return policy.audit_path(private_dir(), cluster_id)


class Gate:
    """The gate every tool call passes: permission, one call at a time, cap, audit."""

    def __init__(self, c: Cluster, perms: Permissions, audit: str):
        self.c, self.perms, self.audit = c, perms, audit
        self.lock = threading.Lock()

    def wrap(self, name: str, need: Need, fn):
        """``fn`` (the agent's arguments only) gated, serialized, capped and audited."""

        @functools.wraps(fn)
        def call(**kwargs):
            t0, allowed, outcome = time.monotonic(), True, "ok"
            try:
                why = policy.refusal(name, need, self.perms)
                if why:
                    allowed, outcome = False, "refused"
                    raise ToolError(why)
                with self.lock:
                    return policy.cap(fn(**kwargs))
            except ToolError:
                raise
            except UserError as e:  # bad input, a refusing state, a failed cell: dpnb's words
                outcome = f"error: {e}"
                report = getattr(e, "report", "")  # a RemoteCellError's per-rank report
                raise ToolError(policy.cap_text(f"{e}\n{report}" if report else str(e))) from e
            except Exception as e:  # the agent gets the cause; the log keeps the trace
                log.warning("tool %s failed: %s: %s", name, type(e).__name__, e, exc_info=True)
                outcome = f"error: {type(e).__name__}: {e}"
                raise ToolError(policy.cap_text(f"{type(e).__name__}: {e}")) from e
            finally:
                rec = policy.audit_record(name, kwargs, allowed=allowed, outcome=outcome,
                                          seconds=time.monotonic() - t0,
                                          cluster_id=self.c.cluster_id)
                policy.append_audit(self.audit, rec)

        return call


def _read_tools(add, c: Cluster, gate: Gate) -> None:
    def status() -> dict[str, Any]:
        """Every rank: host, pid, device, alive/busy/dead, memory; the group's state."""
        return {**tools.status(c), "audit_log": gate.audit,
                "allowed": {"actions": gate.perms.actions, "code": gate.perms.code}}

    def where(ranks: str | None = None) -> dict[str, Any]:
        """Where each rank is now (cell line, collective it is blocked in) and where the
        ranks were when the last failed cell was stopped. ranks: e.g. "0,1" (default all)."""
        return tools.where(c, ranks)

    def last_error() -> dict[str, Any]:
        """The last failed cell: culprit ranks, each rank's error and line, the collective
        each was in, the verdict and the full report."""
        return tools.last_error(c)

    def log(last: int = 20, ranks: bool = False) -> dict[str, Any]:
        """dpnb's log of caught exceptions (this server), and each rank's with ranks=true."""
        return tools.log_records(c, last, ranks)

    for fn in (status, where, last_error, log):
        add(fn, Need.READ)
    for name in ("memory", "profile_summary", "batch_math", "train_progress", "setup"):
        add(_no_args(getattr(tools, name), c), Need.READ, name=name)


def _no_args(impl, c: Cluster):
    """A tool without arguments: ``impl(c)``, described by ``impl``'s docstring."""

    def tool() -> dict[str, Any]:
        return impl(c)

    tool.__doc__ = impl.__doc__
    return tool


def _action_tools(add, c: Cluster) -> None:
    def interrupt(ranks: str | None = None) -> dict[str, Any]:
        """SIGINT (KeyboardInterrupt) to the selected ranks' engines (default all)."""
        return tools.interrupt(c, ranks)

    def restart(hard: bool = False, resume: str | None = None) -> dict[str, Any]:
        """Replace dead engines and re-form the group (hard: every engine, state lost);
        resume: then rebuild the model and load the checkpoint in that folder ("" = latest)."""
        return tools.restart(c, hard, resume)

    def reform() -> dict[str, Any]:
        """Destroy and re-create the process group on a fresh port; state kept."""
        return tools.reform(c)

    def save(path: str) -> dict[str, Any]:
        """Save the wrapped model, optimizer and step to the folder path."""
        return tools.save(c, path)

    for fn in (interrupt, restart, reform, save):
        add(fn, Need.ACTIONS)


def _code_tools(add, c: Cluster) -> None:
    def run_code(code: str, ranks: str | None = None, timeout_s: float = 30.0,
                 profile: bool = False) -> dict[str, Any]:
        """Run Python code as a %%dp cell on the selected ranks (default all), stopped after
        timeout_s seconds (at most 600); each rank's output (capped), value and error.
        profile=true: under torch.profiler (then profile_summary)."""
        if not 0 < timeout_s <= MAX_CODE_TIMEOUT_S:
            raise DpnbError(f"timeout_s must be in (0, {MAX_CODE_TIMEOUT_S:g}] seconds")
        return tools.run_code(c, code, ranks, timeout_s, profile)

    add(run_code, Need.CODE)


def build(c: Cluster, perms: Permissions, audit: str) -> MCPServer:
    """The MCP server for cluster ``c``: every tool, gated by ``perms``."""
    server = MCPServer(name="dpnb", instructions=INSTRUCTIONS, log_level="WARNING")
    gate = Gate(c, perms, audit)
    notes = {Need.READ: READ, Need.ACTIONS: ACT, Need.CODE: CODE}

    def add(fn, need: Need, name: str | None = None) -> None:
        name = name or fn.__name__
        doc = (fn.__doc__ or "").strip().split("\n\n")[0]
        if need != Need.READ:
            doc += f" Needs the server started with {policy.FLAG[need]}."
        server.add_tool(gate.wrap(name, need, fn), name=name, description=doc,
                        annotations=notes[need], structured_output=True)

    _read_tools(add, c, gate)
    _action_tools(add, c)
    _code_tools(add, c)
    return server


def serve(cluster_id: str | None, *, allow_actions: bool = False, allow_code: bool = False,
          http_port: int | None = None) -> int:
    """``dpnb mcp``: attach, serve over stdio until the agent closes it (or over
    streamable HTTP on loopback, behind a token: :mod:`.web`), let go."""
    try:
        c = Cluster.attach(cluster_id)
    except DpnbError as e:
        print(f"dpnb mcp: {e}", file=sys.stderr)
        return 2
    perms = Permissions(actions=allow_actions, code=allow_code)
    audit = audit_file(c.cluster_id)
    print(f"dpnb mcp: attached to kept cluster {c.cluster_id} ({c.world_size} ranks); "
          f"actions {'allowed' if allow_actions else 'refused'}, code "
          f"{'allowed' if allow_code else 'refused'}; audit log {audit}", file=sys.stderr)
    # the agent's client ends a server that does not exit at once with SIGTERM:
    # exit through Python, so that the cluster is let go, not left held by a dead pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server = build(c, perms, audit)
        if http_port is None:
            server.run("stdio")
        else:
            # lazy: uvicorn and starlette load for the HTTP transport only
            from .web import serve_http

            serve_http(server, c.cluster_id, http_port)
    finally:
        if c.running:
            keep.release(c)  # the cluster stays, free for a kernel or another agent
    return 0
