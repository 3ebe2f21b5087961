"""``dpnb mcp``: a Model Context Protocol server over a live dpnb cluster.

The server is one process between an agent and a cluster's holder.  A
cluster that a running kernel holds (started with ``%dp start`` /
``dpnb.start``, kept or not) is served through that kernel's door
(:mod:`.door`): the kernel answers every call beside the human's cells, by
the rules of :mod:`.service`.  A kept cluster that no kernel holds is
attached here (this process holds it then, as a kernel would; at exit it
lets go and the cluster stays for the next kernel or agent) and served
through a door this process opens for itself, by the same rules.

Nothing is serialized here: each call is its own connection, so ``where``,
``status`` and ``interrupt`` answer while a ``run_code`` or the human's cell
runs.  Read-only tools are always served.  Actions (``interrupt``,
``restart``, ``reform``, ``save``) need ``--allow-actions``, ``run_code``
needs ``--allow-code`` -- and, on a kernel's cluster, the notebook's own yes
(``%dp agent --allow-actions --allow-code``); every tool is listed either way,
so that a refusal can name what allows it.  Every call, refused or not, is
appended to the audit log (:func:`audit_file`), and every answer is capped
(:mod:`.policy`).  A long ``run_code`` reports progress (each rank's line,
every second); a cancelled one interrupts the ranks it started.  The
cluster's record, its last error and its last profile are also resources.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from ..cluster import keep
from ..cluster.publish import published
from dpnb.engine.proc.private import private_dir
from ..errors import DpnbError
from . import door, policy
from .policy import Need, Permissions
from .service import TOOLS

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


@dataclass(frozen=True)
class Target:
    """The cluster served: its id, size, the holder's door, and who holds it
    (``kernel_pid``: a running kernel; None: this process, a kept cluster attached)."""

    cluster_id: str
    world_size: int
    door_path: str
    kernel_pid: int | None


class Gate:
    """The gate every call passes: the server's flags, the holder's answer, cap, audit."""

    def __init__(self, target: Target, perms: Permissions, audit: str):
        self.target, self.perms, self.audit = target, perms, audit

    async def call(self, name: str, need: Need, kwargs: dict, ctx: Context | None = None) -> dict:
        """``name(**kwargs)`` asked of the holder, gated, capped and audited."""
        t0, allowed, outcome = time.monotonic(), True, "ok"
        try:
            why = policy.refusal(name, need, self.perms)
            if why:
                allowed, outcome = False, "refused"
                raise ToolError(why)
            report = _progress_reporter(ctx) if ctx is not None else None
            return policy.cap(await door.ask(self.target.door_path, name, kwargs, report))
        except ToolError:
            raise
        except door.DoorError as e:  # refused there, a failed cell, a holder gone
            outcome = str(e) if e.refused else f"error: {e}"  # a refusal says "refused"
            allowed = allowed and not e.refused
            text = f"{e}\n{e.report}" if e.report else str(e)
            raise ToolError(policy.cap_text(text)) from e
        except Exception as e:  # the agent gets the cause; the log keeps the trace
            log.warning("tool %s failed: %s: %s", name, type(e).__name__, e, exc_info=True)
            outcome = f"error: {type(e).__name__}: {e}"
            raise ToolError(policy.cap_text(f"{type(e).__name__}: {e}")) from e
        except BaseException:  # cancelled by the agent: the door's closing cancels it there
            outcome = "cancelled"
            raise
        finally:
            rec = policy.audit_record(name, kwargs, allowed=allowed, outcome=outcome,
                                      seconds=time.monotonic() - t0,
                                      cluster_id=self.target.cluster_id)
            policy.append_audit(self.audit, rec)


def _progress_reporter(ctx: Context):
    """Progress lines from the holder as MCP progress notifications (elapsed seconds,
    each rank's where-line as the message)."""

    async def report(p: dict) -> None:
        try:
            await ctx.report_progress(float(p.get("elapsed_s") or 0.0), None,
                                      policy.cap_text(str(p.get("where") or ""), 2000))
        except Exception as e:  # a client that did not ask for progress: nothing to send
            log.info("progress not sent: %s: %s", type(e).__name__, e)

    return report


def _read_tools(add, gate: Gate) -> None:
    async def status() -> dict[str, Any]:
        """Every rank: host, pid, device, alive/busy/dead, memory; the group's state.
        Answers at once while a cell runs (then from what the holder knows)."""
        out = await gate.call("status", Need.READ, {})
        return {**out, "audit_log": gate.audit, "holder": gate.target.kernel_pid,
                "allowed_by_server": {"actions": gate.perms.actions, "code": gate.perms.code}}

    async def where(ranks: str | None = None) -> dict[str, Any]:
        """Where each rank is now (cell line, collective it is blocked in) and where the
        ranks were when the last failed cell was stopped. ranks: e.g. "0,1" (default all)."""
        return await gate.call("where", Need.READ, {"ranks": ranks})

    async def last_error() -> dict[str, Any]:
        """The last failed cell (the human's or run_code's): culprit ranks, each rank's
        error and line, the collective each was in, the verdict and the full report."""
        return await gate.call("last_error", Need.READ, {})

    async def log(last: int = 20, ranks: bool = False) -> dict[str, Any]:
        """dpnb's log of caught exceptions (the holder), and each rank's with ranks=true."""
        return await gate.call("log", Need.READ, {"last": last, "ranks": ranks})

    for fn in (status, where, last_error, log):
        add(fn, Need.READ)
    for name, doc in (("memory", "Each rank's measured model-state bytes beside the exact "
                                 "prediction for its strategy."),
                      ("profile_summary", "The last profiled cell: compute, exposed "
                                          "communication and idle per rank, the straggler."),
                      ("batch_math", "Global batch = micro-batch x DP x grad-accum from the "
                                     "last train call, and the scaled learning rates."),
                      ("train_progress", "The training session: every train call, and each "
                                         "rank's live progress while one runs."),
                      ("setup", "What restart --resume would replay now, in order.")):
        add(_no_args(gate, name, doc), Need.READ, name=name)


def _no_args(gate: Gate, name: str, doc: str):
    async def tool() -> dict[str, Any]:
        return await gate.call(name, Need.READ, {})

    tool.__doc__ = doc
    return tool


def _action_tools(add, gate: Gate) -> None:
    async def interrupt(ranks: str | None = None) -> dict[str, Any]:
        """SIGINT (KeyboardInterrupt) to the selected ranks' engines (default all): stops
        a hung cell, the human's included."""
        return await gate.call("interrupt", Need.ACTIONS, {"ranks": ranks})

    async def restart(hard: bool = False, resume: str | None = None) -> dict[str, Any]:
        """Replace dead engines and re-form the group (hard: every engine, state lost);
        resume: then rebuild the model and load the checkpoint in that folder ("" = latest)."""
        return await gate.call("restart", Need.ACTIONS, {"hard": hard, "resume": resume})

    async def reform() -> dict[str, Any]:
        """Destroy and re-create the process group on a fresh port; state kept."""
        return await gate.call("reform", Need.ACTIONS, {})

    async def save(path: str) -> dict[str, Any]:
        """Save the wrapped model, optimizer and step to the folder path."""
        return await gate.call("save", Need.ACTIONS, {"path": path})

    for fn in (interrupt, restart, reform, save):
        add(fn, Need.ACTIONS)


def _code_tools(add, gate: Gate) -> None:
    async def run_code(ctx: Context, code: str, ranks: str | None = None,
                       timeout_s: float = 30.0, profile: bool = False) -> dict[str, Any]:
        """Run Python code as a %%dp cell on the selected ranks (default all), stopped after
        timeout_s seconds (at most 600); each rank's output (capped), value and error.
        Refused while the notebook's own cell runs. profile=true: under torch.profiler
        (then profile_summary)."""
        if not 0 < timeout_s <= MAX_CODE_TIMEOUT_S:
            raise ToolError(f"timeout_s must be in (0, {MAX_CODE_TIMEOUT_S:g}] seconds")
        return await gate.call("run_code", Need.CODE, {"code": code, "ranks": ranks,
                                                        "timeout_s": timeout_s,
                                                        "profile": profile}, ctx)

    add(run_code, Need.CODE)


def _resources(server: MCPServer, gate: Gate) -> None:
    """The cluster's record, its last error and its last profile, as JSON resources."""
    for uri, tool, what in (("dpnb://cluster", "status", "the cluster: ranks, group, holder"),
                            ("dpnb://last-error", "last_error", "the last failed cell's report"),
                            ("dpnb://last-profile", "profile_summary",
                             "the last profiled cell's summary")):
        def make(tool=tool):
            async def read() -> str:
                return json.dumps(await gate.call(tool, Need.READ, {}), indent=1)
            return read

        server.resource(uri, name=tool, description=what, mime_type="application/json")(make())


def build(target: Target, perms: Permissions, audit: str) -> MCPServer:
    """The MCP server for the cluster behind ``target``'s door: every tool, gated by ``perms``."""
    server = MCPServer(name="dpnb", instructions=INSTRUCTIONS, log_level="WARNING")
    gate = Gate(target, perms, audit)
    notes = {Need.READ: READ, Need.ACTIONS: ACT, Need.CODE: CODE}

    def add(fn, need: Need, name: str | None = None) -> None:
        name = name or fn.__name__
        assert TOOLS[name][0] == need, name  # one table of what each tool needs
        doc = (fn.__doc__ or "").strip().split("\n\n")[0]
        if need != Need.READ:
            doc += (f" Needs the server started with {policy.FLAG[need]}, and on a kernel's "
                    f"cluster the notebook's yes (%dp agent {policy.FLAG[need]}).")
        server.add_tool(fn, name=name, description=doc, annotations=notes[need],
                        structured_output=True)

    _read_tools(add, gate)
    _action_tools(add, gate)
    _code_tools(add, gate)
    _resources(server, gate)
    return server


def published_doors() -> dict[str, dict]:
    """The clusters running kernels hold and serve through a door, by id."""
    return {r["id"]: r for r in published() if r.get("agent_door")}


def choose(cluster_id: str | None) -> tuple[dict | None, str]:
    """Which cluster to serve: ``(published record, id)`` for a kernel's, ``(None, id)``
    for a kept one no kernel holds; one-line errors otherwise."""
    doors = published_doors()
    free = {r["id"]: r for r in keep.kept() if not r["holder"]}
    ids = sorted(set(doors) | set(free))
    if cluster_id:
        ids = [i for i in ids if i == cluster_id or i.startswith(cluster_id)]
        if not ids:
            raise DpnbError(f"no cluster {cluster_id!r} to serve: neither a running kernel's "
                            f"nor a kept one (%dp list shows the kept ones)")
    if not ids:
        raise DpnbError("no dpnb cluster to serve: start one in a notebook (%dp start -n 2) "
                        "or keep one (%dp start -n 2 --keep 2h)")
    if len(ids) > 1:
        raise DpnbError(f"{len(ids)} clusters: say which with --attach ID ({', '.join(ids)})")
    return doors.get(ids[0]), ids[0]


def serve(cluster_id: str | None, *, allow_actions: bool = False, allow_code: bool = False,
          http_port: int | None = None) -> int:
    """``dpnb mcp``: find the cluster, serve over stdio until the agent closes it (or over
    streamable HTTP on loopback, behind a token: :mod:`.web`); a kept cluster attached
    here is let go at the end."""
    # lazy: a kernel's cluster is served without loading torch or ipyparallel here
    from ..session import Cluster

    own = None
    try:
        rec, cid = choose(cluster_id)
        if rec is not None:
            target = Target(cid, len(rec.get("ranks") or []), rec["agent_door"],
                            int(rec["kernel"]["pid"]))
        else:
            own = Cluster.attach(cid)
            own.allow_agent(actions=allow_actions, code=allow_code)  # no notebook to ask
            d = door.open_door(own)
            if d is None:
                raise DpnbError(f"could not open a door to cluster {cid} here (see the log)")
            target = Target(cid, own.world_size, d.path, None)
    except DpnbError as e:
        print(f"dpnb mcp: {e}", file=sys.stderr)
        if own is not None and own.running:
            keep.release(own)
        return 2
    perms = Permissions(actions=allow_actions, code=allow_code)
    audit = audit_file(cid)
    held = (f"held by kernel {target.kernel_pid} (actions and code only as its notebook "
            f"allows: %dp agent)" if target.kernel_pid else "kept, attached here")
    print(f"dpnb mcp: serving cluster {cid} ({target.world_size} ranks, {held}); actions "
          f"{'allowed' if allow_actions else 'refused'}, code "
          f"{'allowed' if allow_code else 'refused'} by this server; audit log {audit}",
          file=sys.stderr)
    # the agent's client ends a server that does not exit at once with SIGTERM:
    # exit through Python, so that a kept cluster is let go, not left held by a dead pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server = build(target, perms, audit)
        if http_port is None:
            server.run("stdio")
        else:
            # lazy: uvicorn and starlette load for the HTTP transport only
            from .web import serve_http

            serve_http(server, cid, http_port)
    finally:
        if own is not None:
            own.close_agent_door()
            if own.running:
                keep.release(own)  # the cluster stays, free for a kernel or another agent
    return 0
