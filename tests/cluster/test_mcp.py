"""``dpnb mcp`` driven by the MCP SDK's own stdio client, over one kept 2-rank cluster.

The module starts a kept cluster (``keep``), sets a variable on its ranks,
lets go of it as a kernel that exits does, and then runs ``dpnb mcp`` as an
agent's client would -- a child process speaking MCP on its stdin/stdout --
once per set of flags.  The cluster is stopped at the end, on failure too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

import dpnb
from dpnb.cluster import keep

mcp = pytest.importorskip("mcp")  # the agent extra (pip install "dpnb[agent]"); CI installs it

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
import httpx2  # noqa: E402  (the SDK's HTTP client)

READ_TOOLS = {"status", "where", "last_error", "log", "memory", "profile_summary", "batch_math",
              "train_progress", "setup"}
ACTION_TOOLS = {"interrupt", "restart", "reform", "save"}


SETUP = """import torch, dpnb.data
ds = dpnb.data.SyntheticRegression(n=64, in_dim=8, out_dim=2, seed=1)
net = torch.nn.Linear(8, 2)
marker = 1234 + rank
"""


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A kept 2-rank cluster no kernel holds: ``(id, pids, env)``; ``marker`` is set on it."""
    base = tmp_path_factory.mktemp("mcp")
    env = dict(os.environ, DPNB_STATE_DIR=str(base / "kept"), XDG_RUNTIME_DIR=str(base / "run"),
               DPNB_PREWARM="0")
    os.makedirs(env["XDG_RUNTIME_DIR"], mode=0o700)
    mp = pytest.MonkeyPatch()
    mp.setenv("DPNB_STATE_DIR", env["DPNB_STATE_DIR"])
    c = dpnb.start(2, keep="10m", timeout=6.0)
    pids = [r.pid for r in c.ranks]
    try:
        c.run(SETUP, display=False, setup=True)
        c.wrap("net", "ddp", lr=0.05)
        c.set_data("ds")
        c.train(steps=2, micro_batch=4, progress=False)
        keep.release(c)  # as a kernel that exits: the cluster stays, free to attach
        yield c.cluster_id, pids, env
    finally:
        try:
            dpnb.attach(c.cluster_id).stop()
        except Exception as e:  # never leave engines behind: kill what the start made
            print(f"stopping the kept cluster by attaching failed ({e}); killing its engines")
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # gone already
        mp.undo()


def _agent(env: dict, flags: list[str], script):
    """Run ``dpnb mcp FLAGS`` and ``await script(session)`` against it; its result."""

    async def main():
        server = StdioServerParameters(command=sys.executable,
                                       args=["-m", "dpnb.cli", "mcp", *flags], env=env,
                                       cwd=env["XDG_RUNTIME_DIR"])  # profiles go below it
        async with stdio_client(server) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                return await script(s)

    return asyncio.run(main())


async def _calls(s, *calls):
    """``[(name, args), ...]`` -> each CallToolResult, in order."""
    return [await s.call_tool(name, args) for name, args in calls]


def _text(res) -> str:
    return "".join(getattr(b, "text", "") for b in res.content)


def test_read_only_by_default_lists_tools_reports_two_ranks_and_refuses_actions(kept):
    cid, pids, env = kept

    async def script(s):
        listed = (await s.list_tools()).tools
        res = await _calls(s, ("status", {}), ("where", {}),
                           ("restart", {"hard": True}), ("reform", {}),
                           ("run_code", {"code": "marker = 0"}), ("status", {}))
        return listed, res

    listed, (st, where, restart, reform, code, st2) = _agent(env, [], script)
    tools = {t.name: t for t in listed}
    assert READ_TOOLS | ACTION_TOOLS | {"run_code"} <= set(tools)
    assert all(tools[n].annotations.read_only_hint for n in READ_TOOLS)
    assert all(tools[n].annotations.destructive_hint and not tools[n].annotations.read_only_hint
               for n in ACTION_TOOLS | {"run_code"})

    s = st.structured_content
    assert not st.is_error and s["cluster"] == cid and s["world_size"] == 2
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and [r["pid"] for r in s["ranks"]] == pids
    assert all(r["alive"] and r["state"] == "ok" for r in s["ranks"])
    assert not where.is_error and "rank 0: idle" in where.structured_content["now"]

    for refused, flag in ((restart, "--allow-actions"), (reform, "--allow-actions"),
                          (code, "--allow-code")):
        assert refused.is_error and "refused" in _text(refused) and flag in _text(refused)
    # touched nothing: the same engines, the same group
    s2 = st2.structured_content
    assert [r["pid"] for r in s2["ranks"]] == pids and s2["generation"] == s["generation"]

    with open(s["audit_log"]) as f:
        audit = [json.loads(line) for line in f]
    assert oct(os.stat(s["audit_log"]).st_mode & 0o777) == "0o600"
    mine = [a for a in audit if a["server_pid"] == audit[-1]["server_pid"]]
    assert [(a["tool"], a["allowed"]) for a in mine] == [
        ("status", True), ("where", True), ("restart", False), ("reform", False),
        ("run_code", False), ("status", True)]
    assert mine[2]["args"]["hard"] is True and mine[2]["outcome"] == "refused"


def test_the_session_tools_answer_from_the_kept_record_and_the_ranks(kept):
    """The wrap, the train call and the setup log a kernel left in the record, and the
    ranks' live memory, come back as JSON; a tool with nothing to report says so."""
    cid, pids, env = kept

    async def script(s):
        return await _calls(s, ("memory", {}), ("batch_math", {}), ("train_progress", {}),
                            ("setup", {}), ("profile_summary", {}), ("log", {"ranks": True}))

    res = _agent(env, [], script)
    assert not any(r.is_error for r in res), [_text(r) for r in res if r.is_error]
    mem, batch, train, setup, prof, log = (r.structured_content for r in res)
    assert mem["available"] and mem["agrees"] and mem["strategy"] == "ddp"
    assert [r["rank"] for r in mem["ranks"]] == [0, 1]
    # Linear(8, 2), fp32 DDP: 18 parameters of 4 bytes on every rank
    assert all(r["measured"]["params"] == 18 * 4 for r in mem["ranks"]), mem["ranks"]
    assert batch["live"]["dp"] == 2 and batch["live"]["micro_batch"] == 4
    assert batch["global_samples"] == 4 * 2 * 1  # micro-batch x DP x grad-accum
    assert train["steps_done"] == 2 and train["last_wrap"]["model"] == "net"
    assert setup["available"] and any("wrap net (ddp)" in line for line in setup["replay"])
    assert prof["available"] is False and "no profile yet" in prof["why"]
    assert set(log["ranks"]) == {"0", "1"}


PROFILED = """import torch, torch.distributed as dist
for _ in range(3):
    dist.all_reduce(torch.ones(1000))
"""
ONE_SIDED = """import torch, torch.distributed as dist
if rank == 0:
    dist.all_reduce(torch.ones(3))
"""


def test_with_allow_code_state_is_there_output_is_capped_and_a_hang_is_diagnosed(kept):
    cid, pids, env = kept

    async def script(s):
        return await _calls(s, ("run_code", {"code": "marker"}),
                            ("run_code", {"code": "print('x' * 10_000_000)", "ranks": "0"}),
                            ("run_code", {"code": PROFILED, "profile": True}),
                            ("profile_summary", {}),
                            ("run_code", {"code": ONE_SIDED, "timeout_s": 10}),
                            ("where", {}), ("last_error", {}), ("reform", {}))

    marker, big, profiled, prof, hang, where, err, reform = _agent(env, ["--allow-code"], script)
    # the variable set before the refused calls is still on every rank
    vals = marker.structured_content["ranks"]
    assert (vals["0"]["value"], vals["1"]["value"]) == ("1234", "1235"), vals

    out = big.structured_content["ranks"]["0"]["stdout"]
    assert "characters cut" in out and len(out) < 25_000 and out.rstrip().endswith("x")
    assert len(json.dumps(big.structured_content)) < 110_000

    assert profiled.structured_content["ok"], _text(profiled)
    p = prof.structured_content
    assert p["available"] and [r["rank"] for r in p["ranks"]] == [0, 1], p
    assert p["summary"][0].startswith("Profiled cell on 2 of 2 ranks")

    h = hang.structured_content
    assert not hang.is_error and h["ok"] is False and "error" in h
    w = where.structured_content["last_failure"]
    assert "rank 0 is blocked in all_reduce" in w["verdict"] and "cell line 3" in w["verdict"], w
    e = err.structured_content
    assert e["available"] and 0 in e["culprits"], e
    assert e["where"]["0"]["collective"]["op"] == "all_reduce"
    assert e["where"]["0"]["line"].startswith("cell line 3"), e["where"]
    assert reform.is_error and "--allow-actions" in _text(reform)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_answers_only_with_the_token(kept):
    """``--http``: on loopback, a request without the token is refused before MCP;
    the SDK's HTTP client with it gets the same tools."""
    from mcp.client.streamable_http import streamable_http_client

    cid, pids, env = kept
    port = _free_port()
    token_file = os.path.join(env["XDG_RUNTIME_DIR"], "dpnb", f"mcp-token-{cid}")
    p = subprocess.Popen([sys.executable, "-m", "dpnb.cli", "mcp", "--http", str(port)], env=env,
                         stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        said = ""
        while "streamable HTTP" not in said:  # the server is up once it has written its token
            line = p.stderr.readline()
            assert line, said + "(the server exited)"
            said += line
        assert os.stat(token_file).st_mode & 0o777 == 0o600
        with open(token_file) as f:
            token = f.read()

        async def main():
            async with httpx2.AsyncClient(timeout=30) as raw:
                for _ in range(100):  # uvicorn binds just after the line above
                    try:
                        stranger = await raw.post(url, json={"jsonrpc": "2.0", "id": 1,
                                                             "method": "tools/list"})
                        break
                    except httpx2.ConnectError:
                        await asyncio.sleep(0.1)
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx2.AsyncClient(headers=auth, timeout=30) as http:
                async with streamable_http_client(url, http_client=http) as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        return stranger, await s.call_tool("status", {})

        stranger, st = asyncio.run(main())
        assert stranger.status_code == 401
        assert not st.is_error and [r["pid"] for r in st.structured_content["ranks"]] == pids
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert not os.path.exists(token_file)


def test_with_allow_actions_an_action_is_carried_out(kept):
    cid, pids, env = kept

    async def script(s):
        return await _calls(s, ("status", {}), ("reform", {}), ("status", {}),
                            ("run_code", {"code": "marker = 0"}))

    before, reform, after, code = _agent(env, ["--allow-actions"], script)
    assert not reform.is_error, _text(reform)
    g0 = before.structured_content["generation"]
    assert reform.structured_content["generation"] == g0 + 1
    assert after.structured_content["generation"] == g0 + 1
    assert all(r["pid"] in pids for r in after.structured_content["ranks"])
    assert code.is_error and "--allow-code" in _text(code)
