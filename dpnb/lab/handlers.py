"""The tornado handlers of ``/api/dpnb``: JSON in, JSON out, behind the server's own auth.

Each handler is a jupyter_server ``APIHandler``: ``@web.authenticated`` refuses a
request without the server's token or login cookie (403 for an API request),
and ``@authorized`` asks the server's authorizer (JupyterHub's scopes on a
hosted server) whether this user may act on kernels -- a dpnb cluster is a
kernel's processes, so whoever may not touch the kernels may not touch it.
POSTs also need the XSRF token when the browser's cookie is the credential.
Nothing blocks the server's loop, which answers the user's notebooks too: the
listing and the actions run in worker threads, and GPU memory is read on a
thread of its own (:class:`dpnb.lab.clusters.GpuMemory`).
"""

from __future__ import annotations

import asyncio
import json

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from . import clusters as cl
from . import start as st
from .mcp import McpHost, NotServed, serve_asgi


class _Base(APIHandler):
    auth_resource = "kernels"


class ClustersHandler(_Base):
    """``GET /api/dpnb/clusters``: ``{"clusters": [...]}``, see :func:`dpnb.lab.clusters.clusters`."""

    def initialize(self, gpu: cl.GpuMemory) -> None:
        self.gpu = gpu  # one reading of GPU memory per server, reused across requests

    @web.authenticated
    @authorized
    async def get(self) -> None:
        # the records are files and /proc reads: off the loop that serves the notebooks
        listing = await asyncio.to_thread(cl.clusters, self.gpu)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"clusters": listing}, default=str))


class ActionHandler(_Base):
    """``POST /api/dpnb/clusters/ID/ACTION``: stop, interrupt, restart, restart-resume, attach-code."""

    @web.authenticated
    @authorized
    async def post(self, cluster_id: str, action: str) -> None:
        try:
            out = await asyncio.to_thread(cl.act, cluster_id, action)
        except KeyError:
            self.set_status(404)
            out = {"message": f"no dpnb cluster {cluster_id}"}
        except cl.ActionError as e:
            # written here, not raised as HTTPError: tornado formats its log line
            # with the text, and the text says %dp
            self.set_status(409)
            out = {"message": str(e)}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(out, default=str))


class StartHandler(_Base):
    """``POST /api/dpnb/clusters/start`` with ``{"n": 2, "launcher": "local"}``: a kept
    cluster started in a process of its own (:mod:`dpnb.lab.start`); for ssh or Slurm,
    the ``%dp start`` line the sidebar runs in the notebook; 400 with one line for a
    body ``%dp start`` would refuse, nothing started."""

    @web.authenticated
    @authorized
    async def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None  # not JSON: refused by checked() with the line saying what to give
        try:
            st.checked(body)  # quick: refuse bad input before the worker thread
            out = await asyncio.to_thread(st.start, body)
        except st.StartRequestError as e:
            self.set_status(400)
            out = {"message": str(e)}
        except RuntimeError as e:  # the starting process failed: its last line
            self.set_status(500)
            out = {"message": str(e)}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(out, default=str))


class McpHandler(_Base):
    """``/dpnb/mcp[/ID]``: MCP over streamable HTTP (GET, POST, DELETE), handed to the
    cluster's MCP session manager once the server's auth let the request in
    (:mod:`.mcp`)."""

    on_gone = None  # set while a request streams: the client closed the connection

    def initialize(self, host: McpHost) -> None:
        self.host = host

    def check_xsrf_cookie(self) -> None:
        # an agent sends its token in a header, never a cookie; a browser's cookie alone
        # is refused (a cookie-only request must still carry the XSRF token)
        if "Authorization" not in self.request.headers:
            super().check_xsrf_cookie()

    async def _serve(self, cluster_id: str | None) -> None:
        try:
            mgr = await self.host.manager_for(cluster_id)
        except NotServed as e:
            self.set_status(404)
            self.finish(json.dumps({"message": str(e)}))
            return
        except ImportError:
            self.set_status(501)
            self.finish(json.dumps({"message": 'the mcp SDK is not installed in the Jupyter '
                                               'server\'s environment: pip install "dpnb[agent]"'}))
            return
        await serve_asgi(self, mgr)
        if not self._finished:
            self.finish()

    def on_connection_close(self) -> None:
        if self.on_gone is not None:
            self.on_gone()

    @web.authenticated
    @authorized
    async def get(self, cluster_id: str | None = None) -> None:
        await self._serve(cluster_id)

    @web.authenticated
    @authorized
    async def post(self, cluster_id: str | None = None) -> None:
        await self._serve(cluster_id)

    @web.authenticated
    @authorized
    async def delete(self, cluster_id: str | None = None) -> None:
        await self._serve(cluster_id)


def handlers(base_url: str) -> list[tuple]:
    api = url_path_join(base_url, "api", "dpnb", "clusters")
    mcp = url_path_join(base_url, "dpnb", "mcp")
    return [(mcp + r"(?:/([\w.-]+))?", McpHandler, {"host": McpHost()}),
            (api, ClustersHandler, {"gpu": cl.GpuMemory()}),
            (url_path_join(api, "start"), StartHandler),
            (url_path_join(api, r"([\w.-]+)", r"(stop|interrupt|restart-resume|restart|attach-code)"),
             ActionHandler)]
