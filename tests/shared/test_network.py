"""A third host on the cluster network (not part of the cluster) against an ssh cluster.

Two hosts run the engines; the intruder runs in a third network namespace on
the same bridge, so it reaches rank 0's store and every side door by
address, as a machine on a shared cluster network would.  It does not have
the cluster's secret.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest
from helpers import hosts as _hosts
from helpers.releases import assert_release_is_fast

import dpnb

INTRUDER = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "intruder.py"


@pytest.fixture(scope="module")
def three_hosts():
    with _hosts.hosts_or_skip(3, "shared-host tier (network)") as hs:
        yield hs


def _argv(host, plan: dict) -> list[str]:
    return ["ip", "netns", "exec", host.ns, sys.executable, str(INTRUDER), json.dumps(plan)]


def _rss(c) -> dict[int, int]:
    res = c.run("import psutil\nprint(psutil.Process().memory_info().rss)", display=False)
    return {r: int(res.stdout[r].split()[-1]) for r in res.ranks}


def test_a_third_host_learns_nothing_and_slows_nothing(three_hosts):
    a, b, x = three_hosts.hosts
    c = dpnb.start(4, engines="ssh", ssh_config=three_hosts.ssh_config, timeout=20,
                   remote_python=sys.executable, launcher_args=[f"{a.name}=2", f"{b.name}=2"])
    try:
        c.run("keep = 42", display=False)
        store = [c.master_addr, c.master_port]
        doors = [list(d) for d in c.transport.doors.values()]
        assert all(not d[0].startswith("/") for d in doors), doors  # across hosts: TCP doors
        p = subprocess.run(_argv(x, {"store": store, "raw": [store, doors[1]]}),
                           capture_output=True, text=True, timeout=90)
        assert p.returncode == 0, p.stderr[-2000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        s = got["store"]
        assert not any(k in s for k in ("list_keys", "get", "set")), s
        for raw in got["raw"]:
            assert raw["greeting_bytes"] == 32 and raw.get("answer", "") == "", raw
            assert raw["closed_after"] < 8, raw

        rss0 = _rss(c)
        attack = subprocess.Popen(_argv(x, {"hold": {"targets": [store, *doors], "seconds": 20,
                                                     "per_target": 8}}),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(2.0)
            assert_release_is_fast(c, raising_rank=3)
        finally:
            out, err = attack.communicate(timeout=90)
        assert attack.returncode == 0, err[-2000:]
        held = json.loads(out.strip().splitlines()[-1])["hold"]
        # every stranger's connection to dpnb's own ports ended within the
        # handshake deadline (5 s), whatever it sent
        for kind in ("silent", "dribble", "huge"):
            assert held[kind] and max(held[kind]) < 8, (kind, held[kind])
        grew = {r: _rss(c)[r] - rss0[r] for r in rss0}
        assert max(grew.values()) < 64 << 20, grew
        c.run("x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 4 and keep == 42",
              display=False)
    finally:
        c.stop()
