"""``/dpnb/mcp/ID``: ``dpnb mcp`` served by the Jupyter server itself, behind its own auth.

A hosted user's agent cannot start ``dpnb mcp`` beside the kernel (it runs
elsewhere) and should not need a second token or port: the Jupyter server the
user already reaches -- with a Jupyter token, or JupyterHub's OAuth and its
scopes -- serves the same MCP over streamable HTTP at ``/dpnb/mcp/<cluster
id>`` (``/dpnb/mcp``: the only cluster).  The handler (:mod:`.handlers`)
authenticates and authorises the request exactly as ``/api/dpnb`` (a user who
may not touch kernels may not touch a cluster), then hands it, as ASGI, to
the MCP SDK's session manager of that cluster, built here once per cluster
and run on the server's event loop.  Its tools ask the cluster's holder
through the holder's door (:mod:`dpnb.agent.door`), like ``dpnb mcp``.

What the agent may change is the notebook's to say (``%dp agent``,
``c.allow_agent``): a request here already carries the user's own Jupyter
credential, which can run any code in the user's kernels, so the server's
own permission is all of it (the stdio command's ``--allow-*`` flags exist
for an agent that holds no such credential) and the notebook's yes is the
gate.  A kept cluster that no kernel holds is not served here (it has no
door; ``dpnb mcp`` attaches it).  Every call goes to the same audit log.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class NotServed(LookupError):
    """No cluster to serve at this URL (the message says which exist)."""


class McpHost:
    """The server's MCP session managers, one per cluster served (built on first use)."""

    def __init__(self):
        self._managers: dict[str, object] = {}
        self._tasks: set[asyncio.Task] = set()  # each manager's run(), as long as the server

    def _choose(self, cluster_id: str | None) -> dict:
        # lazy: the agent extra (mcp) loads with the first request, not with the server
        from ..agent import server as srv

        doors = srv.published_doors()
        if cluster_id is None and len(doors) == 1:
            return next(iter(doors.values()))
        if cluster_id in doors:
            return doors[cluster_id]
        have = ", ".join(sorted(doors)) or "none"
        raise NotServed(f"no running kernel's cluster {cluster_id or ''} to serve here "
                        f"(serving: {have}); /dpnb/mcp/ID picks one")

    async def manager_for(self, cluster_id: str | None):
        """The session manager of the cluster at this URL, running on this loop."""
        rec = self._choose(cluster_id)
        cid = rec["id"]
        mgr = self._managers.get(cid)
        if mgr is not None:
            return mgr
        # lazy: the agent extra (mcp) loads with the first request, not with the server
        from mcp.server.transport_security import TransportSecuritySettings
        from ..agent import server as srv
        from ..agent.policy import Permissions

        target = srv.Target(cid, len(rec.get("ranks") or []), rec["agent_door"],
                            int(rec["kernel"]["pid"]))
        server = srv.build(target, Permissions(actions=True, code=True), srv.audit_file(cid))
        # the Jupyter server checks hosts and origins itself, before this handler
        server.streamable_http_app(transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=False))
        mgr = server.session_manager
        started = asyncio.Event()

        async def run() -> None:
            async with mgr.run():
                started.set()
                await asyncio.Event().wait()  # serves until the server's loop ends

        task = asyncio.ensure_future(run())
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            waiter.cancel()
            task.result()  # raises why it could not start
        self._managers[cid] = mgr
        self._tasks.add(task)
        log.info("dpnb: serving MCP for cluster %s at /dpnb/mcp/%s", cid, cid)
        return mgr


async def serve_asgi(handler, mgr) -> None:
    """Hand the tornado request of ``handler`` to the ASGI app ``mgr.handle_request``,
    streaming its response (an SSE stream included) back through tornado."""
    req = handler.request
    gone = asyncio.Event()
    handler.on_gone = gone.set
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": req.method, "scheme": req.protocol, "path": "/mcp", "raw_path": b"/mcp",
             "query_string": (req.query or "").encode(), "root_path": "",
             # the Jupyter credential stops here: the MCP SDK never sees it
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                         for k, v in req.headers.get_all()
                         if k.lower() not in ("authorization", "cookie")],
             "server": ("127.0.0.1", 0), "client": (req.remote_ip or "", 0)}
    body = [req.body or b""]

    async def receive() -> dict:
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            handler.set_status(msg["status"])
            handler.clear_header("Content-Type")
            for k, v in msg.get("headers") or []:
                name = k.decode("latin-1")
                if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                    handler.add_header(name, v.decode("latin-1"))
        elif msg["type"] == "http.response.body":
            if msg.get("body"):
                handler.write(msg["body"])
            if not gone.is_set():
                try:
                    await handler.flush()
                except Exception as e:  # the client went away mid-stream
                    log.info("MCP response not delivered: %s: %s", type(e).__name__, e)
                    gone.set()

    await mgr.handle_request(scope, receive, send)
