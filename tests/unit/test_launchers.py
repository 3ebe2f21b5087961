"""The launcher classes, without starting anything: which class a start gets, where
its controller listens, how its engines become ranks, how many ranks a resize
may ask for, and where grown engines go."""

from __future__ import annotations

import os
import types

import pytest

from dpnb.cluster.launchers import launcher_for
from dpnb.cluster.launchers.base import ENGINES_PER_CORE
from dpnb.cluster.launchers.slurm_mpi import MpiLauncher, SlurmLauncher
from dpnb.cluster.launchers.local import LocalLauncher, ZygoteLauncher
from dpnb.cluster.launchers.ssh import SshLauncher
from dpnb.cluster.types import LaunchSpec, RankInfo
from dpnb.errors import DpnbError


def _ranks(hosts: list[str]) -> list[RankInfo]:
    per = {h: hosts.count(h) for h in hosts}
    return [RankInfo(rank=i, engine_id=i, host=h, ip="10.0.0.1", pid=100 + i,
                     local_rank=hosts[:i].count(h), local_world_size=per[h],
                     node_rank=list(per).index(h), device="cpu", location=h)
            for i, h in enumerate(hosts)]


def _cluster(hosts, backend="gloo", gpus=None):
    ranks = _ranks(hosts)
    return types.SimpleNamespace(ranks=ranks, world_size=len(ranks), backend=backend, gpus=gpus)


@pytest.mark.parametrize("spec, kind", [
    (LaunchSpec(engines="local"), LocalLauncher),
    (LaunchSpec(engines="local", zygote=True), ZygoteLauncher),
    (LaunchSpec(engines="ssh", launcher_args=("a=2",)), SshLauncher),
    (LaunchSpec(engines="slurm"), SlurmLauncher),
    (LaunchSpec(engines="mpi"), MpiLauncher),
])
def test_each_start_gets_its_launcher_class(spec, kind):
    assert type(launcher_for(spec)) is kind


def test_an_unknown_launcher_is_refused_in_one_line():
    with pytest.raises(DpnbError, match="unknown launcher 'pbs'"):
        launcher_for(LaunchSpec(engines="pbs"))


def test_local_engines_listen_on_loopback_unless_told():
    assert launcher_for(LaunchSpec(engines="local")).controller_ip() == "127.0.0.1"
    assert launcher_for(LaunchSpec(engines="local", zygote=True)).controller_ip() == "127.0.0.1"
    assert launcher_for(LaunchSpec(engines="mpi")).controller_ip() == "127.0.0.1"  # no hostfile
    told = LaunchSpec(engines="local", controller_ip="10.1.2.3")
    assert launcher_for(told).controller_ip() == "10.1.2.3"


def test_launcher_settings_are_checked_before_anything_starts(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")  # a host with ssh
    with pytest.raises(DpnbError, match="the local launcher takes no --launcher-arg"):
        launcher_for(LaunchSpec(engines="local", launcher_args=("x=1",))).check(2)
    with pytest.raises(DpnbError):
        launcher_for(LaunchSpec(engines="ssh", launcher_args=("a=1",))).check(2)  # 1 slot, 2 ranks
    launcher_for(LaunchSpec(engines="ssh", launcher_args=("a=1", "b=1"))).check(2)


def test_no_ssh_client_is_one_line_before_anything_starts(monkeypatch, tmp_path):
    """A hosted server's PATH often has no ssh: the ssh launcher says so, the local one needs none."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DpnbError, match="needs an ssh client on PATH") as e:
        launcher_for(LaunchSpec(engines="ssh", launcher_args=("a=1", "b=1"))).check(2)
    assert "\n" not in str(e.value)
    launcher_for(LaunchSpec(engines="local")).check(2)


def test_ranks_follow_the_launcher_s_own_order():
    assert launcher_for(LaunchSpec(engines="slurm")).rank_order(4) == {"by_launch_rank": True}
    assert launcher_for(LaunchSpec(engines="mpi")).rank_order(4) == {"by_launch_rank": True}
    assert launcher_for(LaunchSpec(engines="local")).rank_order(4) == {"by_launch_rank": False}
    ssh = launcher_for(LaunchSpec(engines="ssh", launcher_args=("b=2", "a=2")))
    assert ssh.rank_order(4) == {"host_order": ["b", "a"]}  # as the user listed them


def test_resize_capacity_per_launcher():
    c = _cluster(["h", "h"])
    cores = os.cpu_count() or 1
    assert launcher_for(LaunchSpec(engines="local")).capacity(c.ranks, c.backend, c.gpus)[0] == ENGINES_PER_CORE * cores
    n, why = launcher_for(LaunchSpec(engines="slurm")).capacity(c.ranks, c.backend, c.gpus)
    assert n == 2 and "placed its engines once" in why
    ssh = launcher_for(LaunchSpec(engines="ssh", launcher_args=("h=3", "g=3")))
    ssh.agents = types.SimpleNamespace(counts={"h": 3, "g": 3})
    assert ssh.capacity(c.ranks, c.backend, c.gpus) == (6, "the HOST=N slots given to --launcher-arg")
    gpu = _cluster(["h", "h", "g", "g"], backend="nccl", gpus=[0, 1, 2])
    assert ssh.capacity(gpu.ranks, gpu.backend, gpu.gpus) == (6, "one GPU per rank, 3 per host")


def test_grown_engines_go_to_free_slots_or_to_the_zygote():
    ssh = launcher_for(LaunchSpec(engines="ssh", launcher_args=("h=2", "g=3")))
    ssh.agents = types.SimpleNamespace(counts={"h": 2, "g": 3})
    c = _cluster(["h", "h", "g"])
    assert ssh._free_slots(c.ranks, 2) == {"g": 2}
    assert ssh._free_slots(c.ranks, 1) == {"g": 1}
    z = launcher_for(LaunchSpec(engines="local", zygote=True))
    assert z._free_slots(c.ranks, 5) == {"localhost": 5}


def test_only_unheld_unkept_engines_watch_the_kernel():
    assert launcher_for(LaunchSpec(engines="local")).watch_kernel
    assert not launcher_for(LaunchSpec(engines="local", kept=True)).watch_kernel
    z = launcher_for(LaunchSpec(engines="local", zygote=True))
    z.agents = object()  # the zygote agent ends its engines itself
    assert not z.watch_kernel


@pytest.mark.parametrize("engines, kept, asked, env, want", [
    ("ssh", False, None, {}, "auto"),  # each host decides by its own NVIDIA driver
    ("ssh", False, True, {}, "on"),
    ("ssh", False, False, {}, "off"),  # --no-zygote
    ("ssh", True, None, {}, "off"),  # a kept cluster's engines must outlive the agent's pipe
    ("ssh", False, None, {"OMP_NUM_THREADS": "1"}, "off"),  # read by torch as it loads
    ("ssh", False, None, {"MY_FLAG": "1"}, "auto"),  # given to the engines at hello: fine
    ("slurm", False, True, {}, "off"),
    ("local", False, True, {}, "off"),  # the local zygote is LaunchSpec.zygote's
])
def test_ssh_hosts_fork_their_engines_unless_torch_would_load_differently(engines, kept, asked,
                                                                           env, want):
    from dpnb.cluster.launch import host_zygote_for

    assert host_zygote_for(engines, kept=kept, asked=asked, env=env) == want


def test_a_frozen_engine_is_told_apart_by_host_and_pid():
    """Two hosts' PID spaces are their own: rank 1 on host a and rank 2 on host b
    can both be PID 100; only the stopped one is frozen."""
    ranks = [RankInfo(rank=i, engine_id=i, host=h, ip="10.0.0.1", pid=100, local_rank=0,
                      local_world_size=1, node_rank=i, device="cpu", location=h)
             for i, h in enumerate(["a", "b"])]
    launcher = SshLauncher(LaunchSpec(engines="ssh", launcher_args=("a=1", "b=1")))
    asked = []

    class Agents:
        def states(self, host, pids):
            asked.append((host, sorted(pids)))
            return {100: "stopped"} if host == "b" else {}

    launcher.agents = Agents()
    assert launcher.frozen_states(ranks) == {("b", 100): "stopped"}
    assert sorted(asked) == [("a", [100]), ("b", [100])]


class _SilentZygote:
    """A zygote agent that has not reported an exit yet (``report`` sets what it will say)."""

    def __init__(self):
        self.report = None

    def exit_of(self, host, pid):
        return self.report


def test_an_engine_ended_here_is_dead_before_its_zygote_reports(monkeypatch):
    """A zygote cluster's engine SIGKILLed from outside, then a restart at once:
    the zygote has not reaped it (a zombie) nor reported it, and the controller
    still lists it.  Its PID says it ended; the zygote's words, if they come
    within the wait, say how."""
    import signal
    import subprocess
    import sys
    import time

    from dpnb.cluster.launchers import local

    monkeypatch.setattr(local, "REPORT_WAIT_S", 0.3)
    zl = launcher_for(LaunchSpec(engines="local", zygote=True))
    zl.agents = _SilentZygote()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ri = _ranks(["localhost"])[0]
        ri = RankInfo(**{**ri.__dict__, "pid": child.pid})
        never_noted = RankInfo(**{**ri.__dict__, "pid": os.getpid()})
        zl.remember([ri])
        assert zl.exit_of(ri, None) is None  # it runs
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(250):  # bounded: the kill lands, the child is a zombie (not reaped)
            if open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] == "Z":
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"pid {child.pid} did not become a zombie after SIGKILL")
        assert "has not reported how yet" in zl.exit_of(ri, None)
        zl.agents.report = "killed by signal 9 (SIGKILL)"
        assert zl.exit_of(ri, None) == "killed by signal 9 (SIGKILL)"
        assert zl.exit_of(never_noted, None) == "killed by signal 9 (SIGKILL)"
        zl.agents.report = None
        assert zl.exit_of(never_noted, None) is None  # a PID never noted: only the zygote can say
    finally:
        child.kill()
        child.wait()


def test_a_kill_pending_or_an_exit_under_way_counts_as_ended():
    """``kill -9`` returns with the signal queued; the engine becomes a zombie only
    once it has unmapped its memory.  Meanwhile its /proc files say so."""
    from dpnb.cluster.processes import kill_under_way

    status = open("/proc/self/status").read()
    stat = open("/proc/self/stat").read()
    assert not kill_under_way(status, stat)  # this process: running, nothing pending

    def pending(field, mask):
        return "\n".join(f"{field}:\t{mask:016x}" if line.startswith(field + ":") else line
                         for line in status.splitlines())

    assert kill_under_way(pending("SigPnd", 1 << 8), stat)  # SIGKILL queued to the thread
    assert kill_under_way(pending("ShdPnd", 1 << 8), stat)  # ... or to the process
    assert not kill_under_way(pending("ShdPnd", 1 << 1), stat)  # SIGINT pending: not ending
    head, tail = stat.rsplit(")", 1)
    fields = tail.split()
    exiting = fields[:6] + [str(int(fields[6]) | 0x4)] + fields[7:]
    assert kill_under_way(status, "123 (a) b) " + " ".join(exiting))  # PF_EXITING; a ')' in the name
    quiet = fields[:6] + [str(int(fields[6]) & ~0x4)] + fields[7:]
    assert not kill_under_way(status, "123 (a) b) " + " ".join(quiet))


def test_a_plain_engine_being_killed_is_ended_for_local_exit(monkeypatch):
    """A plain local engine (``--no-zygote``) killed a moment ago is not yet a
    zombie: ``local_exit`` asks ``over``, which asks ``ending`` (its /proc files, read by
    ``kill_under_way``, tested above) and says it ended."""
    import subprocess
    import sys
    import types as pytypes

    from dpnb.cluster import processes

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        icluster = pytypes.SimpleNamespace(engines={})  # no launcher of ipyparallel's: code unknown
        monkeypatch.setattr(processes, "ending", lambda pid: pid == child.pid)
        assert processes.local_exit(icluster, child.pid) == "process gone, exit status unknown"
        monkeypatch.setattr(processes, "ending", lambda pid: False)
        assert processes.local_exit(icluster, child.pid) is None  # it runs
    finally:
        child.kill()
        child.wait()
