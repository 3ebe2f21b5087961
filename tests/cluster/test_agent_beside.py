"""An agent beside the human on one live cluster: ``dpnb mcp`` on a notebook's own cluster.

The human is an IPython shell with ``%load_ext dpnb`` that ran ``%dp start``
(not kept): its cluster lives in this process, and its cells run on a thread
of this test as a kernel's would.  The agent is ``dpnb mcp`` as an agent's
client starts it -- a child process speaking MCP on stdio, driven by the MCP
SDK's own client -- which finds the cluster through the notebook's
publication and asks the notebook's door.  While the human's cell hangs,
the agent's reads answer within a second, its code is refused, its interrupt
(once the notebook allowed it) frees the human's cell; while the agent's
code runs, the human's cell is refused, progress comes, and a cancelled
call frees the ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time

import pytest

mcp = pytest.importorskip("mcp")  # the agent extra (pip install "dpnb[agent]"); CI installs it

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
# the SDK's client checks each structured result with jsonschema, imported at its first
# call (1.1 s here): imported now, so that the bounds below time dpnb, not that import
import jsonschema  # noqa: E402,F401

import dpnb  # noqa: E402
from dpnb.agent.server import audit_file  # noqa: E402

#: what "answers at once" means here: the cells below run for a minute
READ_BOUND_S = 1.0

HUNG = """%%dp
import time
if rank == 1:
    time.sleep(60)
print("human cell done on", rank)
"""
ALL_REDUCE = """import torch
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
t.item()
"""


@pytest.fixture(scope="module")
def human(ip):
    """The notebook: its shell, its cluster (with the door ``%dp start`` opened)."""
    ip.run_line_magic("dp", "start -n 2 --timeout 20")
    c = dpnb.get_cluster(ip)
    assert c.agent_door is not None and os.path.exists(c.agent_door.path)
    yield ip, c
    c.allow_agent()


def _env() -> dict:
    # the same private folder as this process (pytest points TMPDIR at its own)
    return dict(os.environ, TMPDIR=tempfile.gettempdir(), DPNB_PREWARM="0")


def _agent(cluster_id: str, script, flags=("--allow-actions", "--allow-code")):
    async def main():
        server = StdioServerParameters(command=sys.executable,
                                       args=["-m", "dpnb.cli", "mcp", "--attach", cluster_id,
                                             *flags], env=_env())
        async with stdio_client(server) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                await s.list_tools()  # what an agent does first (the client caches schemas)
                return await script(s)

    return asyncio.run(main())


async def _timed(s, name, args=None, **kw):
    t0 = time.monotonic()
    res = await s.call_tool(name, args or {}, **kw)
    return res, time.monotonic() - t0


def _text(res) -> str:
    return "".join(getattr(b, "text", "") for b in res.content)


class _Cell(threading.Thread):
    """The human runs a cell in the notebook (the shell), as a kernel does."""

    def __init__(self, ip, code: str):
        super().__init__(daemon=True)
        self.ip, self.code, self.result, self.ended = ip, code, None, None

    def run(self):
        self.result = self.ip.run_cell(self.code)
        self.ended = time.monotonic()


def test_a_hung_human_cell_is_read_and_interrupted_by_the_agent_the_notebook_allowing_it(
        human, capsys):
    ip, c = human
    c.allow_agent()  # the notebook has said nothing yet: reads only
    cell = _Cell(ip, HUNG)
    cell.start()
    deadline = time.monotonic() + 30
    while 1 not in {r for r, a in c.transport.where([1]).items() if a and a.get("busy")}:
        assert time.monotonic() < deadline, "the human's cell never started on rank 1"
        time.sleep(0.1)
    marks = {}

    async def script(s):
        out = {}
        out["status"] = await _timed(s, "status")
        out["where"] = await _timed(s, "where")
        out["code"] = await _timed(s, "run_code", {"code": ALL_REDUCE})
        out["refused_interrupt"] = await _timed(s, "interrupt")
        c.allow_agent(actions=True, code=True)  # the human says yes (the notebook's side)
        out["code_now"] = await _timed(s, "run_code", {"code": ALL_REDUCE})
        marks["interrupt"] = time.monotonic()
        out["interrupt"] = await _timed(s, "interrupt")
        cell.join(10)
        out["sum"] = await _timed(s, "run_code", {"code": ALL_REDUCE})
        out["last_error"] = await _timed(s, "last_error")
        return out

    out = _agent(c.cluster_id, script)
    for name in ("status", "where", "code", "refused_interrupt", "code_now", "interrupt"):
        assert out[name][1] < READ_BOUND_S, (name, out[name][1])
    st, where = out["status"][0].structured_content, out["where"][0].structured_content
    assert st["world_size"] == 2 and [r["pid"] for r in st["ranks"]] == [r.pid for r in c.ranks]
    assert "the notebook" in st["running"] and all(r["state"].startswith("busy") for r in st["ranks"])
    assert "rank 1 is running Python code at cell line 3" in where["now"], where

    code, refused = out["code"][0], out["refused_interrupt"][0]
    assert code.is_error and "refused by the notebook" in _text(code) \
        and "--allow-code" in _text(code)
    assert refused.is_error and "%dp agent --allow-actions" in _text(refused)
    code_now = out["code_now"][0]
    assert code_now.is_error and "the ranks are running the notebook" in _text(code_now)

    # the interrupt freed the human's cell within 3 s; its error names the interrupt
    assert not cell.is_alive() and cell.ended - marks["interrupt"] < 3.0, \
        cell.ended - marks["interrupt"]
    assert not out["interrupt"][0].is_error
    total = out["sum"][0].structured_content
    assert total["ok"] and {v["value"] for v in total["ranks"].values()} == {"3.0"}, total
    err = out["last_error"][0].structured_content
    assert err["culprits"] == [1] and "time.sleep(60)" in err["ranks"]["1"]["line"], err

    # the notebook shows what the agent did, after the cell it did it to
    said = capsys.readouterr().out
    assert "agent (dpnb mcp, pid" in said and ": interrupt -> ok" in said, said
    assert "run_code on ranks all" not in said.split(": interrupt -> ok")[0].split("pid")[-1]

    # every call is in the audit log, the refusals as refusals
    with open(audit_file(c.cluster_id)) as f:
        audit = [json.loads(line) for line in f]
    mine = [(a["tool"], a["allowed"]) for a in audit if a["server_pid"] == audit[-1]["server_pid"]]
    assert mine == [("status", True), ("where", True), ("run_code", False),
                    ("interrupt", False), ("run_code", False), ("interrupt", True),
                    ("run_code", True), ("last_error", True)], mine


def test_the_agents_code_refuses_the_human_reports_progress_and_a_cancel_frees_the_ranks(
        human, capsys):
    ip, c = human
    ip.run_line_magic("dp", "agent --allow-code")  # the human's yes, from the notebook
    assert "may do reads, code on cluster" in capsys.readouterr().out
    seen = []

    async def progress(value, total, message):
        seen.append((value, message))

    async def script(s):
        out = {}
        run = asyncio.ensure_future(s.call_tool(
            "run_code", {"code": "import time\nif rank == 0:\n    time.sleep(60)"},
            read_timeout_seconds=4, progress_callback=progress))
        await asyncio.sleep(2.5)
        human_cell = _Cell(ip, "%%dp\nprint('human')")
        human_cell.start()
        await asyncio.to_thread(human_cell.join, 10)
        out["human"] = human_cell.result
        out["status"] = await _timed(s, "status")
        try:
            out["run"] = await run
        except Exception as e:  # the read timeout abandons the call: cancelled at the server
            out["run"] = e
        out["cancelled_at"] = time.monotonic()
        while c.turn.holder is not None and time.monotonic() - out["cancelled_at"] < 10:
            await asyncio.sleep(0.1)
        out["freed_s"] = time.monotonic() - out["cancelled_at"]
        out["after"] = await _timed(s, "run_code", {"code": ALL_REDUCE})
        return out

    out = _agent(c.cluster_id, script)
    said = capsys.readouterr()
    assert out["human"].error_in_exec is not None or "an agent's run_code" in said.err + said.out
    assert "the ranks are running an agent's run_code" in said.err + said.out, said
    assert out["status"][1] < READ_BOUND_S and "an agent's run_code" in \
        out["status"][0].structured_content["running"]
    assert seen and "rank 0 is running Python code at cell line 3" in seen[-1][1], seen
    assert isinstance(out["run"], Exception), out["run"]
    assert out["freed_s"] < 5.0, out["freed_s"]
    after = out["after"][0].structured_content
    assert after["ok"] and {v["value"] for v in after["ranks"].values()} == {"3.0"}, after
    # and the notebook goes on
    res = ip.run_cell("%%dp\nprint('human again', rank)")
    assert res.error_in_exec is None
    # %dp agent: what is allowed, the agent seen, what it did
    ip.run_line_magic("dp", "agent")
    said = capsys.readouterr().out
    assert "may do reads, code" in said and "last call" in said, said
    assert "run_code on ranks all: 'import time' -> failed" in said, said


SLOW_MODEL = """%%dp
import time, torch, dpnb.data

class Slow(torch.nn.Module):
    # a step of about 50 ms: the agent looks in while the human's training runs
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.05)
        return self.lin(x)

net = Slow()
ds = dpnb.data.SyntheticRegression(n=256, in_dim=8, out_dim=2, seed=1)
"""


def test_the_agent_watches_the_humans_training_live(human):
    ip, c = human
    c.allow_agent()
    assert ip.run_cell(SLOW_MODEL).error_in_exec is None
    c.wrap("net", "ddp", lr=0.05)
    c.set_data("ds")
    done = {}

    def train():
        # with its progress (the default): rank 0 publishes each step as it trains
        done["result"] = c.train(steps=240, micro_batch=4)  # outlives the agent's two looks, unloaded too

    human_train = threading.Thread(target=train, daemon=True)
    human_train.start()

    async def script(s):
        looks = []
        for _ in range(2):
            await asyncio.sleep(1.0)
            looks.append(await _timed(s, "train_progress"))
        looks.append(await _timed(s, "status"))
        return looks

    first, second, status = _agent(c.cluster_id, script, flags=())
    assert human_train.is_alive(), "the training ended before the agent looked twice"
    human_train.join(60)
    for res, took in (first, second, status):
        assert not res.is_error and took < READ_BOUND_S, (took, _text(res))
    a, b = first[0].structured_content, second[0].structured_content
    assert "the notebook" in a["running"] and "0" in a["live"], a
    assert b["live"]["0"]["step"] > a["live"]["0"]["step"], (a["live"], b["live"])
    assert done["result"] is not None and c.training.steps_done >= 80



def test_the_agents_actions_on_the_notebooks_cluster_once_the_notebook_allows_them(
        human, tmp_path):
    """save, reform and restart, each refused until the notebook says yes, then done on
    the notebook's own cluster: its state and its records follow."""
    ip, c = human
    c.allow_agent()
    assert ip.run_cell("%%dp\nimport torch\nlin = torch.nn.Linear(4, 2)").error_in_exec is None
    c.wrap("lin", "ddp", lr=0.1)  # something to save
    ckpt = str(tmp_path / "ckpt")
    calls = (("save", {"path": ckpt}), ("reform", {}), ("restart", {}))

    async def script(s):
        refused = [await s.call_tool(n, a) for n, a in calls]
        c.allow_agent(actions=True)
        return refused, [await s.call_tool(n, a) for n, a in calls]

    g0, pids = c.generation, [r.pid for r in c.ranks]
    refused, done = _agent(c.cluster_id, script, flags=("--allow-actions",))
    assert all(r.is_error and "%dp agent --allow-actions" in _text(r) for r in refused)
    assert not any(r.is_error for r in done), [_text(r) for r in done]
    save, reform, restart = (r.structured_content for r in done)
    assert os.path.isdir(ckpt) and os.listdir(ckpt), save
    # the notebook's own cluster moved: a new group (reform), the same engines (no one died)
    assert reform["generation"] == g0 + 1 and c.generation >= g0 + 1
    assert restart["pids"] == pids == [r.pid for r in c.ranks]
    res = ip.run_cell("%%dp\nx = torch.ones(1); dist.all_reduce(x); print(x.item())")
    assert res.error_in_exec is None
