"""``/dpnb/mcp``: an agent reaches a notebook's live cluster through the Jupyter server's own URL and auth.

A real ``jupyter server`` with dpnb's extension (:mod:`helpers.labserver`), and
a cluster this test's process holds as a notebook would (``dpnb.start``: its
publication goes where the server reads, its door is open).  The agent is the
MCP SDK's own streamable HTTP client carrying the Jupyter token -- no second
token, no second port.  Without the token, or with a wrong one, the server
refuses before any tool runs; with it, the tools answer, and changing the
cluster needs the notebook's yes.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from helpers import labserver

import dpnb

mcp = pytest.importorskip("mcp")  # the agent extra (pip install "dpnb[agent]"); CI installs it

from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
import httpx2  # noqa: E402  (the SDK's HTTP client)

from dpnb.agent.server import audit_file  # noqa: E402

ALL_REDUCE = "import torch\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()\n"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "stranger", "version": "0"}}}


def test_the_jupyter_servers_url_and_token_serve_a_notebooks_cluster(tmp_path, monkeypatch):
    with labserver.running(tmp_path) as srv:
        # the notebook's side: its publication where this server reads them
        monkeypatch.setenv("DPNB_PUBLISH_DIR", srv.env["DPNB_PUBLISH_DIR"])
        c = dpnb.start(2, timeout=6.0)
        try:
            _check(srv, c)
        finally:
            c.stop()


def _check(srv, c) -> None:
    url = f"{srv.base}/dpnb/mcp/{c.cluster_id}"

    async def main():
        async with httpx2.AsyncClient(timeout=60) as raw:
            stranger = await raw.post(url, json=INIT, headers={"Accept": "application/json, "
                                                                         "text/event-stream"})
            wrong = await raw.post(url, json=INIT, headers={"Authorization": "token nope",
                                                            "Accept": "application/json"})
        auth = {"Authorization": f"token {srv.token}"}
        async with httpx2.AsyncClient(headers=auth, timeout=60) as http:
            async with streamable_http_client(url, http_client=http) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    out = [await s.call_tool("status", {}), await s.call_tool("where", {}),
                           await s.call_tool("run_code", {"code": ALL_REDUCE})]
                    c.allow_agent(code=True)  # the notebook's yes
                    out.append(await s.call_tool("run_code", {"code": ALL_REDUCE}))
                    out.append(await s.read_resource("dpnb://cluster"))
                    return stranger, wrong, out

    audit = audit_file(c.cluster_id)
    stranger, wrong, (st, where, refused, total, res) = asyncio.run(main())
    assert stranger.status_code == 403 and wrong.status_code == 403, (stranger, wrong)
    s = st.structured_content
    assert not st.is_error and s["world_size"] == 2 and s["holder"] == os.getpid()
    assert [r["pid"] for r in s["ranks"]] == [r.pid for r in c.ranks]
    assert "rank 0: idle" in where.structured_content["now"]
    assert refused.is_error and "%dp agent --allow-code" in refused.content[0].text
    t = total.structured_content
    assert t["ok"] and {v["value"] for v in t["ranks"].values()} == {"3.0"}, t
    assert json.loads(res.contents[0].text)["world_size"] == 2
    with open(audit) as f:
        calls = [json.loads(line)["tool"] for line in f]
    # the strangers' requests never reached a tool: only the token holder's calls are here
    assert calls == ["status", "where", "run_code", "run_code", "status"], calls
