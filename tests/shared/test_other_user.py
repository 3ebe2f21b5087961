"""A second unix user on the same machine against a running local cluster.

The cluster is the test's (root's); the intruder is an unprivileged user who
knows everything ``/proc/net/tcp`` and ``/tmp`` show -- the ports, the paths --
but not the cluster's secret.  Asserted: they learn and change nothing, they
cannot slow a release, and the cluster goes on with its state.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import time

import psutil
import pytest
from helpers.releases import assert_release_is_fast

import dpnb


@pytest.fixture(scope="module")
def shared_tmp(intruder):
    """A fresh shared /tmp (mode 1777) where the intruder plants the folders the
    engines would use first: dpnb's private folder and torch's compile cache."""
    d = tempfile.mkdtemp(prefix="dpnb-shared-tmp-")
    os.chmod(d, 0o1777)
    planted = [os.path.join(d, f"dpnb-{os.getuid()}"), os.path.join(d, "torchinductor_root")]
    got = intruder.run({"plant": planted[0]})
    assert got["uid"] != 0 and got["plant"]
    intruder.run({"plant": planted[1]})
    yield d, planted
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(shared_tmp):
    d, _ = shared_tmp
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", d)  # the engines inherit it: their tempfile.gettempdir()
    mp.delenv("XDG_RUNTIME_DIR", raising=False)
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(d, "torchinductor_root"))  # torch's default
    c = dpnb.start(2, timeout=10)
    try:
        c.run("keep = 42", display=False)
        yield c
    finally:
        c.stop()
        mp.undo()


def _engine_listening(c) -> dict[int, list[int]]:
    """rank -> the TCP ports its engine process listens on (what a stranger can see)."""
    out = {}
    for ri in c.ranks:
        conns = psutil.Process(ri.pid).net_connections(kind="tcp")
        out[ri.rank] = sorted({x.laddr.port for x in conns if x.status == psutil.CONN_LISTEN})
    return out


def test_planted_folders_are_not_used(cluster, shared_tmp):
    _, planted = shared_tmp
    res = cluster.run("import os\nprint(os.environ['TORCHINDUCTOR_CACHE_DIR'], "
                      "os.environ['TRITON_CACHE_DIR'])", display=False)
    paths = {p for r in res.ranks for p in res.stdout[r].split()}
    assert paths, res
    for p in paths | {os.path.dirname(a) for a, _ in cluster.transport.doors.values()}:
        assert not any(p == x or p.startswith(x + "/") for x in planted), (p, planted)
        st = os.stat(os.path.dirname(p) if p.endswith(("torchinductor", "triton")) else p)
        assert st.st_uid == os.getuid() and not st.st_mode & 0o077, (p, oct(st.st_mode))
    for a, _ in cluster.transport.doors.values():
        assert stat.S_ISSOCK(os.stat(a).st_mode)


def test_store_and_side_doors_refuse_the_other_user(cluster, intruder):
    c = cluster
    store = ["127.0.0.1", c.master_port]
    doors = [a for a, _ in c.transport.doors.values()]
    got = intruder.run({"store": store, "raw": [store], "unix": doors})
    # torch's own store client gets nowhere: no key listed, read or written
    s = got["store"]
    assert not any(k in s for k in ("list_keys", "get", "set")), s
    assert s["seconds"] < 20, s
    # a raw client is greeted with a nonce, then dropped, with no answer to its guess
    (raw,) = got["raw"]
    assert raw["greeting_bytes"] == 32 and raw.get("answer", "") == "", raw
    assert raw["closed_after"] < 8, raw
    # the side doors are UNIX sockets in a 0700 folder: not even a connection
    assert all(u == {"connected": False, "error": "PermissionError"} for u in got["unix"]), got
    # ... and the cluster goes on: a cell, a re-formation, the state
    c.run("x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 2 and keep == 42",
          display=False)
    assert c.reform()["problems"] == []
    c.run("x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 2", display=False)


def test_held_connections_do_not_slow_a_release(cluster, intruder):
    """Slow, silent and endless connections to every port the engines listen on
    (the store, gloo's listeners) while a rank raises, the notebook asks
    ``where``, the group re-forms and a killed rank is replaced."""
    c = cluster
    ports = _engine_listening(c)
    assert c.master_port in ports[0], ports
    targets = [["127.0.0.1", p] for ps in ports.values() for p in ps]
    rss0 = {ri.rank: psutil.Process(ri.pid).memory_info().rss for ri in c.ranks}
    attack = intruder.start({"hold": {"targets": targets, "seconds": 20, "per_target": 8}})
    try:
        time.sleep(2.0)  # every connection open, the endless lines flowing
        assert_release_is_fast(c, raising_rank=1)
        victim = c.ranks[1]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while 1 not in c.transport.find_dead([1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "rank 1 replaced" in c.restart()
        c.run("x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 2", display=False)
        c.run("assert keep == 42", ranks=[0], display=False)
    finally:
        held = intruder.result(attack)
    # every refusal is in rank 0's log, but at most once a minute per listener
    # (the store's server is new at each formation: three here)
    res = c.call("dpnb.engine.runner.log_records", 500, ranks=[0])
    refused = [x for x in res.values[0] if "refused a connection" in x]
    assert 1 <= len(refused) <= 4, refused
    # rank 0 took every endless line the intruder sent and kept none of it
    grew = psutil.Process(c.ranks[0].pid).memory_info().rss - rss0[0]
    assert grew < 64 << 20, f"rank 0 grew by {grew >> 20} MiB"
    # ... and the attack ran: every kind of connection was open and held
    h = held["hold"]
    assert h.get("huge") and h.get("dribble") and h.get("silent"), held
    assert held["uid"] != 0
