"""Every private torch / ipyparallel internal dpnb touches still exists in the installed versions.

dpnb.compat (torch) and dpnb.ippcompat (ipyparallel, ipykernel) are the one
place each is used; if a torch upgrade renames one,
this fails naming it, instead of a re-form or the gradsync view failing later
on a user's cluster.  torch runs in a subprocess with a world-size-1 gloo
group (a few seconds), so no process group lives in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpnb import compat, ippcompat

SCRIPT = """
import json, torch.distributed as dist
from torch.distributed import HashStore
dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
from dpnb import compat, ippcompat
print(json.dumps(compat.check_torch()))
dist.destroy_process_group()
"""


def test_torch_internals_dpnb_uses_exist():
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    problems = json.loads(p.stdout.strip().splitlines()[-1])
    assert problems == [], "dpnb.compat needs updating for this torch:\n" + "\n".join(problems)


def test_ipyparallel_internals_dpnb_uses_exist():
    assert ippcompat.check_ipyparallel() == []


def test_result_metadata_reads_raw_and_public_metadata():
    class Raw:
        _metadata = [{"stdout": "hi"}]

    class Public:
        metadata = {"stdout": "there"}

    assert ippcompat.result_metadata(Raw())["stdout"] == "hi"
    assert ippcompat.result_metadata(Public())["stdout"] == "there"


def test_missing_internal_is_a_clear_error():
    class Zero:  # a ZeroRedundancyOptimizer without the fields dpnb re-binds
        pass

    with pytest.raises(compat.CompatError, match="ZeroRedundancyOptimizer.*missing in torch"):
        compat.point_zero_at_group(Zero(), None)


def test_torch_213_collective_names_exist_on_every_supported_torch(monkeypatch):
    import torch.distributed as dist

    from dpnb.compat import ensure_single_collectives

    ensure_single_collectives()  # torch 2.13 has them already; an older one gets them now
    assert ensure_single_collectives() == []  # and a second call adds nothing
    # an older torch (< 2.13): only the old names
    monkeypatch.delattr(dist, "reduce_scatter_single")
    monkeypatch.delattr(dist, "all_gather_single")
    assert ensure_single_collectives() == ["reduce_scatter_single", "all_gather_single"]
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
    assert dist.all_gather_single is dist.all_gather_into_tensor


def test_a_rank_reply_reads_one_engines_message_future():
    """The transport's per-rank handle (not ``AsyncResult.split``) on the very
    futures ipyparallel's client fills: the reply, the raw output metadata,
    the engine's "idle", and an engine's error raised as ``get`` raises it."""
    from ipyparallel.client.client import ExecuteReply
    from ipyparallel.client.futures import MessageFuture
    from ipyparallel.error import RemoteError, TimeoutError as ResultTimeout

    def future(msg_id):
        f = MessageFuture(msg_id)
        f.output = MessageFuture(msg_id)
        f.output.metadata = {"stdout": ""}
        return f

    f = future("m1")
    rr = ippcompat.RankReply(f)
    assert not rr.ready() and not rr.wait(0.01) and ippcompat.reply_content(rr) == {}
    with pytest.raises(ResultTimeout):
        rr.get(0)
    f.output.metadata["stdout"] = "hi\n"  # the IO thread fills it as stdout arrives
    assert ippcompat.result_metadata(rr)["stdout"] == "hi\n"
    reply = ExecuteReply("m1", {"status": "ok", "execution_count": 1, "dpnb_out": {"stdout": 3}}, {})
    f.set_result(reply)
    assert rr.ready() and rr.get(0) is reply
    assert ippcompat.reply_content(rr)["dpnb_out"] == {"stdout": 3}
    idle = ippcompat.output_wait(rr)
    assert not idle(0.01)
    f.output.set_result(None)  # the engine's "idle" status came
    assert idle(0.01)
    g = future("m2")
    g.set_result(RemoteError("ValueError", "bench", "Traceback ..."))  # how the client stores it
    with pytest.raises(RemoteError, match="bench"):
        ippcompat.RankReply(g).get(0)
