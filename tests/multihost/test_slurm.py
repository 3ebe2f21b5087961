"""Slurm for real: slurmctld here, a slurmd on each of two hosts, engines through sbatch."""

import os
import signal
import sys
import time

import pytest

import dpnb
from helpers import slurm as _slurm


@pytest.fixture(scope="module")
def slurm(two_hosts):
    why = _slurm.missing()
    if why:
        pytest.skip(f"slurm: {why}")
    with _slurm.SlurmCluster(two_hosts) as sl:
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = sl.conf
        try:
            yield sl
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old


def test_slurm_start_train_restart_stop(two_hosts, slurm, tmp_path, monkeypatch):
    hs = two_hosts
    monkeypatch.chdir(tmp_path)  # the notebook's folder: nothing may land there
    t0 = time.monotonic()
    c = dpnb.start(4, engines="slurm", timeout=20, start_timeout=90,
                   launcher_args=["nodes=2", "options=--ntasks-per-node=2"])
    try:
        start_s = time.monotonic() - t0
        hosts = [r.host for r in c.ranks]
        # both hosts, ranks contiguous per host, each host's local ranks 0..1
        assert set(hosts) == {h.name for h in hs.hosts}
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
        assert [r.local_rank for r in c.ranks] == [0, 1, 0, 1]
        assert slurm.jobs(), "the engines' job is in the queue while the cluster runs"
        c.run("import dpnb.data\ntorch.manual_seed(0)\n"
              "ds = dpnb.data.SyntheticRegression(n=256, in_dim=8, out_dim=1, seed=0)\n"
              "net = torch.nn.Linear(8, 1)", display=False, setup=True)
        c.wrap("net", "ddp")
        c.set_data("ds")
        out = c.train(steps=3, micro_batch=8, progress=False)
        assert out["last_step"] == 2, out
        # kill rank 3's engine (a PID on this machine: the hosts share its PID
        # namespace); the restart pins the replacement to rank 3's node
        victim = c.ranks[3]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while 3 not in c.transport.find_dead([3]) and time.monotonic() < deadline:
            time.sleep(0.2)
        msg = c.restart()
        assert "rank 3 replaced" in msg, msg
        assert c.ranks[3].host == victim.host and c.ranks[3].local_rank == victim.local_rank
        c.run("x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 4", display=False)
    finally:
        c.stop()
    deadline = time.monotonic() + 20
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert slurm.jobs() == []
    assert sorted(os.listdir(tmp_path)) == [], "batch scripts and job output stay in the profile"
    print(f"slurm start {start_s:.1f} s", file=sys.stderr)


def test_slurm_ranks_follow_the_nodelist_every_start(two_hosts, slurm):
    """Ranks in Slurm's task order (SLURM_PROCID): the job's nodelist order, as
    ``scontrol show hostnames`` gives it, the same every start (two here; the
    ordering's cases are unit tests, "placement:" in break_on_purpose.py)."""
    seen = []
    for _ in range(2):
        c = dpnb.start(4, engines="slurm", timeout=20, start_timeout=90,
                       launcher_args=["nodes=2", "options=--ntasks-per-node=2"])
        try:
            jobs = slurm.run("squeue", "-h", "-o", "%N").stdout.split()
            nodes = slurm.run("scontrol", "show", "hostnames", jobs[0]).stdout.split()
            hosts = [r.host for r in c.ranks]
            seen.append(hosts)
            assert hosts == [nodes[0]] * 2 + [nodes[1]] * 2, (hosts, nodes)
        finally:
            c.stop()
    assert all(h == seen[0] for h in seen), seen
