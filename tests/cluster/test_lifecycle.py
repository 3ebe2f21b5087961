"""Processes: nothing outlives the kernel; clusters do not collide; mpi."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import dpnb


_KERNEL = textwrap.dedent("""
    import json, os, sys, time
    import dpnb
    c = dpnb.start(2, timeout=6)
    c.run("x = rank", display=False)
    print(json.dumps({"pids": c._owned_pids(), "profile": c.profile_dir}), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
""")


def _gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and
                 psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _spawn(mode):
    p = subprocess.Popen([sys.executable, "-c", _KERNEL, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return p, json.loads(line)


def test_no_orphans_when_kernel_exits():
    p, info = _spawn("exit")
    assert len(info["pids"]) >= 3  # controller + 2 engines at least
    p.wait(60)
    assert _gone(info["pids"], 30) == []
    assert not os.path.exists(info["profile"])


def test_no_orphans_when_kernel_is_killed():
    p, info = _spawn("hang")
    assert all(psutil.pid_exists(pid) for pid in info["pids"])
    p.send_signal(signal.SIGKILL)  # no atexit: the reaper must clean up
    p.wait(10)
    assert _gone(info["pids"], 30) == []
    deadline = time.monotonic() + 10
    while os.path.exists(info["profile"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(info["profile"])  # keys removed too


def test_two_clusters_do_not_collide():
    a = dpnb.start(2, timeout=6)
    try:
        b = dpnb.start(2, timeout=6)
        try:
            assert a.profile_dir != b.profile_dir and a.master_port != b.master_port
            a.run("t = torch.ones(1) * 1\ndist.all_reduce(t)", display=False)
            b.run("t = torch.ones(1) * 10\ndist.all_reduce(t)", display=False)
            assert [v.item() for v in a.pull("t")] == [2.0, 2.0]
            assert [v.item() for v in b.pull("t")] == [20.0, 20.0]
            # security: the connection files are for the owner only
            assert os.stat(a.profile_dir).st_mode & 0o077 == 0
            sec = os.path.join(a.profile_dir, "security")
            conn = [f for f in os.listdir(sec) if f.endswith(("-client.json", "-engine.json"))]
            assert conn
            for f in conn:
                assert os.stat(os.path.join(sec, f)).st_mode & 0o077 == 0, f
        finally:
            b.stop()
    finally:
        a.stop()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs openmpi-bin (.ci/run installs it)")
def test_mpi_launcher():
    pytest.importorskip("mpi4py")
    c = dpnb.start(2, engines="mpi", timeout=8, launcher_args=["--oversubscribe"])
    try:
        assert c.launcher == "mpi" and c.world_size == 2
        c.run("import os\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
              "got = (t.item(), os.environ.get('OMPI_COMM_WORLD_SIZE'))", display=False)
        assert c.pull("got") == [(3.0, "2"), (3.0, "2")]
    finally:
        pids = c.stop()
    assert _gone(pids, 20) == []


def test_local_cluster_listens_on_loopback_only():
    """Controller, engines, gloo and the process-group store: 127.0.0.1 only."""
    c = dpnb.start(2, timeout=6)
    try:
        c.run("t = torch.ones(1)\ndist.all_reduce(t)", display=False)
        c.reform()  # a re-formed group's store too
        ours = set(c._owned_pids())
        listening = [conn for pid in ours for conn in psutil.Process(pid).net_connections("inet")
                     if conn.status == psutil.CONN_LISTEN]
        assert any(conn.laddr.port == c.master_port for conn in listening)
        assert {conn.laddr.ip for conn in listening} == {"127.0.0.1"}
    finally:
        c.stop()


def test_sigterm_ends_an_engine_at_once_after_its_atexit_hooks(tmp_path):
    """Every stop sends SIGTERM: the engine runs the user's atexit hooks, then
    dies of the signal (so a death report still names it), without waiting
    for Python's slow teardown of torch; the whole stop leaves nothing."""
    mark = tmp_path / "hook-ran"
    c = dpnb.start(2, timeout=6)
    try:
        c.run(f"import atexit\nif rank == 1:\n    atexit.register(lambda: open({str(mark)!r}, 'w').write('ok'))",
              display=False)
        pid = c.ranks[1].pid
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        with pytest.raises(dpnb.RemoteCellError) as ei:
            c.run("dist.barrier()", display=False)
        assert "signal 15" in ei.value.died[1], ei.value.died
        assert mark.read_text() == "ok"
        # noticed as a death, not waited out: the group timeout is 6 s
        assert time.monotonic() - t0 < 3.0
        owned = c._owned_pids()
    finally:
        c.stop()
    assert _gone(owned, 5) == []
