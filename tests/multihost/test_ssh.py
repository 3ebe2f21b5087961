"""ssh clusters across two hosts: start, addresses, mistakes, restart on the right host, stop;
a rank on the second host rebuilt from its peer copy held on the first."""

import os
import signal
import subprocess
import statistics
import sys
import textwrap
import threading
import time

import pytest
import torch

import dpnb
from dpnb.cluster import transport
from dpnb.engine.train import peercopy
from dpnb.errors import RemoteCellError, StartError
from dpnb.session import replica
from helpers import hosts as _hosts
from helpers.releases import raise_before_all_reduce


def _start(hs, n_per_host=2, **kw):
    a, b = hs.hosts
    kw.setdefault("remote_python", _hosts.remote_python())  # the checkout's dpnb, there too
    return dpnb.start(2 * n_per_host, engines="ssh", ssh_config=hs.ssh_config, timeout=20,
                      launcher_args=[f"{a.name}={n_per_host}", f"{b.name}={n_per_host}"], **kw)


def _profiles() -> set:
    import tempfile

    d = tempfile.gettempdir()
    return {p for p in os.listdir(d) if p.startswith("dpnb-profile-")}


def _no_remote_left(hs, within=10.0):
    deadline = time.monotonic() + within
    while True:
        left = {h.name: hs.remote_pids(h) for h in hs.hosts}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_missing_remote_module_is_shown_fast_and_leaves_nothing(two_hosts):
    before = _profiles()
    t0 = time.monotonic()
    with pytest.raises(StartError) as ei:
        _start(two_hosts, remote_python="python3")  # the remote PATH's Python has no dpnb
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "No module named 'dpnb'" in msg and "--remote-python" in msg, msg
    assert took < 60, took
    assert _profiles() == before
    assert not any(_no_remote_left(two_hosts).values())


def test_two_hosts_addresses_env_restart_and_stop(two_hosts, monkeypatch):
    hs = two_hosts
    a, b = hs.hosts
    c = _start(hs, env=["DPNB_TEST_FORWARDED=yes"])
    try:
        # hosts in the order of the launcher arguments (a first)
        assert [r.host for r in c.ranks] == [a.name, a.name, b.name, b.name]
        assert [r.local_rank for r in c.ranks] == [0, 1, 0, 1]
        # the address each host reaches the controller by, not what its
        # (unresolvable) hostname gives
        assert [r.ip for r in c.ranks] == [a.ip, a.ip, b.ip, b.ip]
        assert c.master_addr == a.ip
        assert c.run("import os\nx = torch.ones(1) * (rank + 1); dist.all_reduce(x)\n"
                     "out = (os.environ['GLOO_SOCKET_IFNAME'], os.environ['DPNB_TEST_FORWARDED'], "
                     "os.environ['LOCAL_RANK'], x.item())", display=False).ok
        outs = c.pull("out")
        assert outs == [("eth1", "yes", str(lr), 10.0) for lr in (0, 1, 0, 1)], outs
        rows = c.status()
        assert [(r["host"], r["local_rank"]) for r in rows] == \
            [(a.name, 0), (a.name, 1), (b.name, 0), (b.name, 1)]

        # a raising rank on the other host releases the rest at once
        c.run("kept = rank * 10", display=False)
        assert raise_before_all_reduce(c, 3)[1] < 10
        assert c.pull("kept") == [0, 10, 20, 30]

        # rank 3 (second host) dies; the restart puts its replacement there,
        # with local rank 1
        old_pid = c.ranks[3].pid
        c.kill_rank(3)
        msg = c.restart()
        assert "rank 3 replaced" in msg, msg
        assert c.ranks[3].host == b.name and c.ranks[3].local_rank == 1
        c.run("import os\nx = torch.ones(1); dist.all_reduce(x)\nlr = os.environ['LOCAL_RANK']",
              display=False)
        assert c.pull("lr") == ["0", "1", "0", "1"]
        assert [c.pull("kept", rank=r) for r in range(3)] == [0, 10, 20]
        assert c.ranks[3].pid != old_pid or c.ranks[3].engine_id != 3
        # a push through the controller's broadcast tree (from 8 ranks on; here
        # from 2) reaches both hosts, the engine registered by the restart too
        monkeypatch.setattr(transport, "BROADCAST_MIN_RANKS", 2)
        c.push({"wide": list(range(100))})
        assert "tree" in c.transport._wide
        assert c.run("assert wide == list(range(100))", display=False).ok
    finally:
        t0 = time.monotonic()
        c.stop()
        stop_s = time.monotonic() - t0
    assert stop_s < 10, stop_s
    assert not any(_no_remote_left(hs).values())


def test_unreachable_store_is_named_within_seconds(two_hosts):
    t0 = time.monotonic()
    with pytest.raises(StartError) as ei:
        _start(two_hosts, n_per_host=1, master_addr="127.0.0.1")
    msg = str(ei.value)
    assert "127.0.0.1:" in msg and "rank 1" in msg and "--master-addr" in msg, msg
    assert "rank 0 reached it" in msg, msg
    assert time.monotonic() - t0 < 60
    assert not any(_no_remote_left(two_hosts).values())


def test_killed_kernel_leaves_no_remote_engine(two_hosts, tmp_path):
    hs = two_hosts
    a, b = hs.hosts
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, dpnb
        c = dpnb.start(2, engines="ssh", ssh_config={hs.ssh_config!r}, timeout=20,
                       remote_python={sys.executable!r},
                       launcher_args=["{a.name}=1", "{b.name}=1"])
        print("up", flush=True)
        time.sleep(600)
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert all(hs.remote_pids(h) for h in hs.hosts)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        left = _no_remote_left(hs, within=20)
        assert not any(left.values()), left
    finally:
        if p.poll() is None:
            p.kill()


def test_ranks_land_on_the_hosts_in_the_order_given_every_start(two_hosts):
    """Rank 0 -- the store, checkpoints, the exported job's first node -- is on the
    first host named, whichever host's engines register first.  Two starts:
    the ordering's cases (registration orders permuted) are unit tests with their
    breaks (tests/unit/test_cluster_pure.py, "placement:" in break_on_purpose.py);
    here it holds end to end, in one order and reversed."""
    hs = two_hosts
    a, b = hs.hosts
    seen = []
    for first, second in [(a, b), (b, a)]:
        c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, timeout=20,
                       remote_python=sys.executable,
                       launcher_args=[f"{first.name}=2", f"{second.name}=2"])
        try:
            seen.append(([r.host for r in c.ranks], [r.local_rank for r in c.ranks],
                         c.master_addr))
        finally:
            c.stop()
    assert seen[0] == ([a.name] * 2 + [b.name] * 2, [0, 1, 0, 1], a.ip), seen
    assert seen[1] == ([b.name] * 2 + [a.name] * 2, [0, 1, 0, 1], b.ip), seen[1]


def test_a_profile_across_two_hosts_is_put_on_one_clock(two_hosts, tmp_path):
    """%%dp --profile with a rank on each host: the traces come home over the
    engines' own connections, the wall clocks are checked against the collectives
    (several hosts), the residual skew is reported, and the late rank is still named."""
    c = _start(two_hosts, n_per_host=1)
    try:
        c.run("from torch.nn.parallel import DistributedDataParallel as DDP\nimport time\n"
              "torch.manual_seed(0)\n"
              "m = DDP(torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]))\n"
              "x = torch.randn(128, 128)\nm(x).sum().backward()", display=False)
        # each rank notes the shared kernel clock as its first layer's gradient is
        # made -- the last one backward makes, right before DDP's all-reduce is
        # entered: the truth the profile's placement of the all-reduces is checked against
        c.run("entered = []\n"
              "m.module[0].weight.register_hook(lambda g: entered.append(time.time()))",
              display=False)
        c.profile("for _ in range(6):\n    loss = m(x).square().mean()\n"
                  "    if rank == 1:\n        time.sleep(0.1)\n    loss.backward()",
                  display=False, out_dir=str(tmp_path))
        rep = c.last_profile.report
        assert {r.host for r in rep.ranks} == {h.name for h in two_hosts.hosts}
        # one kernel's clock underneath: the wall clocks are kept, or moved by less
        # than their precision, never aligned on gloo's span ends (which the busy
        # late rank closes late: that once took 39 ms off its 0.1 s in CI)
        assert "several hosts" in rep.clock_note and rep.skew_s is not None, rep.clock_note
        assert "collectives end with" not in rep.clock_note, rep.clock_note
        # the late rank is named, and each all-reduce's lateness is the one the shared
        # clock saw: a busy CPU moves the lateness itself (with a core-hogging process
        # beside the test, steps read 0.0004 to 0.2 s behind the 0.1 s sleep, and once
        # rank 0 was the later one), so the profile is held to this run's truth
        t0, t1 = c.pull("entered")
        truth = [b - a for a, b in zip(t0, t1)]
        seen = [col.lateness_s for col in rep.collectives if col.op == "all_reduce"]
        assert len(seen) == len(truth) == 6, (seen, truth)
        assert statistics.median(abs(s - abs(t)) for s, t in zip(seen, truth)) < 0.005, \
            (seen, truth, rep.clock_note)
        later = 1 if sum(max(0.0, t) for t in truth) > sum(max(0.0, -t) for t in truth) else 0
        assert rep.straggler.rank == later, (rep.straggler, truth)
        assert c.last_profile.wait(30)
        assert (tmp_path / "rank1.json").is_file() and (tmp_path / "merged.json").is_file()
    finally:
        c.stop()


@pytest.mark.parametrize("lost", [(2,), (2, 3)], ids=["one rank", "the whole second host"])
def test_a_rank_on_the_other_host_is_rebuilt_from_its_holders_copy(two_hosts, lost):
    """ZeRO-2 on 2 + 2 ranks with peer copies every K steps: each rank's copy is
    held on the other host (the hosts told apart by their real hostnames, over
    the copies' own gloo group across the bridge).  Rank 2 -- or both ranks of
    the second host at once, as a lost machine -- is SIGKILLed from outside
    mid-training, as the OOM killer would; ``restart --resume`` with no
    checkpoint ever written puts the replacements on that host with their
    shards from the first host's copies, the others rolled back to their own
    snapshots -- byte for byte -- and training goes on in sync."""
    hs, k, dead = two_hosts, 3, lost[0]
    a, b = hs.hosts
    c = _start(hs)
    try:
        c.run("import dpnb.data\ntorch.manual_seed(0)\n"
              "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))\n"
              "ds = dpnb.data.SyntheticRegression(n=4096, in_dim=8, out_dim=1, seed=0)\n", display=False)
        c.wrap("net", "zero2", optimizer="adamw", lr=0.01)
        c.set_data("ds")
        c.train(steps=k + 1, micro_batch=8, progress=False, peer_copy_every=k)
        said = replica.peer_copy_line(c)  # what %dp memory prints under its figure
        assert "copies held (rank->holder): 0->2, 1->3, 2->0, 3->1; every copy on another " \
            "host than its owner's" in said, said
        # %dp status says the same from the notebook's plan, asking no rank
        planned = replica.planned_placement(c)
        assert planned.startswith(f"peer copies every {k} steps; ") \
            and planned.endswith(said.splitlines()[1]), (planned, said)
        err: list = []

        def train():
            try:  # far more steps than run before the kill: it ends them
                c.train(steps=10**6, micro_batch=8, progress=False)
            except Exception as e:  # asserted below
                err.append(e)

        t = threading.Thread(target=train)
        t.start()
        time.sleep(1.5)
        for r in lost:
            os.kill(hs.outer_pid(b, c.ranks[r].pid), signal.SIGKILL)
        t.join(60)
        assert err and isinstance(err[0], RemoteCellError) and err[0].died, err
        alive = [r for r in range(4) if r not in lost]
        c.run("_p = _dpnb.peer\npeer = (_p.own, _p.copy, _p.own_step, _p.copy_of, "
              "_dpnb.train.step, _p.group[2], _p.spare, _p.spare_step)", ranks=alive,
              display=False)
        want = {r: c.pull("peer", rank=r) for r in alive}
        holders = want[0][5]
        assert holders == [2, 3, 0, 1], holders  # every copy on the other host
        assert all(c.ranks[h].host != c.ranks[r].host for r, h in enumerate(holders))
        # the pair every survivor keeps: a kill while the newest copy was settling
        # can leave one survivor on the pair before it (the others keep that one as
        # their spare; tests/cluster/test_resume_memory.py has the case alone)
        step, reached = min(w[2] for w in want.values()), max(w[4] for w in want.values())

        def pair(r):  # (own snapshot, the copy it holds) at ``step``
            w = want[r]
            if w[2] == step:
                return w[0], w[1]
            assert w[7] == step, (r, w[2], w[7], step)  # its spare: the pair before
            return tuple(w[6])
        # at most K steps lost, plus the steps a copy in flight overlapped (2K - 1 at
        # most: a copy is settled at the next copy point; see test_resume_memory)
        assert want[0][3] == dead and 0 <= reached - step <= 2 * k - 1, (step, reached)
        msg = c.restart(resume=True)
        copies = "; ".join(f"rebuilt from rank {holders[r]}'s copy of rank {r}'s shard"
                           for r in lost)
        assert (f"{'rank 2' if len(lost) == 1 else 'ranks 2-3'} replaced; {copies} at step "
                f"{step:,} ({reached - step} steps lost; others rolled back to it)") in msg, msg
        assert all(c.ranks[r].host == b.name for r in lost)
        expect = {r: pair(r)[0] for r in alive} | {r: pair(holders[r])[1] for r in lost}
        c.run("import dpnb.engine.train.peercopy as _pc\npacked = _pc.pack(_dpnb.train)\n", display=False)
        for r in range(4):  # every rank's state is the snapshot it rolled back to
            (meta, off), (meta0, off0) = peercopy.meta_of(got := c.pull("packed", rank=r)), \
                peercopy.meta_of(expect[r])
            assert meta == meta0 and meta["step"] == step, r
            assert torch.equal(got[off:], expect[r][off0:]), r
        again = c.train(steps=2, micro_batch=8, progress=False)
        assert again["first_step"] == step and again["steps"] == 2
        assert c.check()["ok"]
    finally:
        c.stop()
