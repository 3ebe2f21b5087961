"""dpnb inside JupyterLab: the Jupyter server extension behind the dpnb sidebar.

The browser never talks to a kernel or an engine for the sidebar: it polls
``GET /api/dpnb/clusters`` on the Jupyter server (about once a second), and the
server -- running as the same user as the kernels -- reads the clusters' own
records from this user's private folders: each running kernel's publication
(:mod:`dpnb.cluster.publish`) and the kept clusters' records
(:mod:`dpnb.cluster.keep`).  Actions (``POST /api/dpnb/clusters/ID/ACTION``)
signal local engines by PID, or drive a kept cluster from a short-lived
process of their own (:mod:`dpnb.lab.act`).  ``/dpnb/mcp/ID`` serves an
agent the same MCP tools as ``dpnb mcp`` (:mod:`dpnb.lab.mcp`).  Every handler sits behind the
server's own authentication (token / cookie + XSRF), so on a JupyterHub each
user's server answers only that user.

Enabled by ``jupyter-config/jupyter_server_config.d/dpnb.json`` (installed by
pip); the browser side is the prebuilt labextension in ``dpnb/labextension``.
"""

from __future__ import annotations


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "dpnb.lab"}]


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "dpnb"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Add the ``/api/dpnb`` handlers to a running Jupyter server."""
    # lazy: tornado and jupyter_server only inside a Jupyter server
    from .handlers import handlers

    web_app = serverapp.web_app
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"]))
    serverapp.log.info("dpnb: serving /api/dpnb/clusters for the JupyterLab sidebar, "
                       "/dpnb/mcp for agents")
