"""``dpnb mcp --http PORT``: the same server over streamable HTTP, on loopback, behind a token.

stdio needs no secret: only the process that started the server can talk to
it.  A port can be reached by every local user, so the HTTP transport
answers only requests that carry ``Authorization: Bearer <token>``, compared
in constant time before the request reaches the MCP SDK (a stranger gets 401
and costs no tool call), and it listens on 127.0.0.1 only.  The token is
made fresh per server (or taken from ``$DPNB_MCP_TOKEN``) and written to a
0600 file in the user's private folder, which the agent's configuration
reads; the file is removed when the server ends.
"""

from __future__ import annotations

import hmac
import os
import secrets
import sys

import uvicorn

from dpnb.engine.proc.private import private_dir

#: the only address the HTTP transport listens on
HOST = "127.0.0.1"
TOKEN_ENV = "DPNB_MCP_TOKEN"


def token_file(cluster_id: str) -> str:
    """Where the token of ``cluster_id``'s HTTP server is written (the private folder)."""
    return os.path.join(private_dir(), f"mcp-token-{cluster_id}")


class BearerGate:
    """ASGI: HTTP requests without the token are answered 401 here; the rest
    (and the lifespan events the SDK's session manager needs) go on to ``app``."""

    def __init__(self, app, token: str):
        self.app, self.want = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body",
                            "body": b"dpnb mcp: send Authorization: Bearer <token>\n"})
                return
        await self.app(scope, receive, send)


def serve_http(server, cluster_id: str, port: int) -> None:
    """Serve ``server`` (an ``MCPServer``) on ``http://127.0.0.1:PORT/mcp`` until stopped."""
    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    path = token_file(cluster_id)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600),
              "w") as f:
        f.write(token)
    print(f"dpnb mcp: streamable HTTP on http://{HOST}:{port}/mcp; token in {path}",
          file=sys.stderr, flush=True)
    app = BearerGate(server.streamable_http_app(host=HOST), token)
    try:
        uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning")).run()
    finally:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass  # removed already: nothing left to hide
