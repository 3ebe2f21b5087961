"""The zygote template's protocol, kernel side and host side, with a stand-in
agent instead of torch: forks on request, its forks' pipes, their exits
reported (the kernel cannot wait for a grandchild), its own end at the
socket's end.  The real template under real starts: tests/cluster/test_launchers_local.py."""

import os
import signal
import sys
import time

import psutil
import pytest

from dpnb.cluster.zygote import ForkedAgentProc, WarmZygote

# a template whose forks answer the agent's JSON lines: ping, and stop (exit 3)
STAND_IN = """
import json, os, socket, sys
from dpnb.engine import template

def agent(inp):
    out = os.fdopen(1, "w", buffering=1)
    for line in inp:
        msg = json.loads(line)
        out.write(json.dumps({"id": msg["id"], "ok": True, "pong": os.getpid(),
                              "ppid": os.getppid()}) + "\\n")
        if msg["cmd"] == "stop":
            os._exit(3)
    os._exit(0)

template.serve(socket.socket(fileno=0), agent)
"""


@pytest.fixture
def template():
    w = WarmZygote([sys.executable, "-c", STAND_IN])
    assert w.wait_ready(30)
    yield w
    w.close()


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_each_take_forks_a_new_agent_of_the_template_that_speaks_on_its_own_pipes(template):
    a, b = template.take(), template.take()
    assert isinstance(a.proc, ForkedAgentProc) and a.proc.pid != b.proc.pid
    for agent in (a, b):
        got = agent.request("ping", timeout=10)
        assert got["pong"] == agent.proc.pid and got["ppid"] == template.pid
        assert agent.proc.poll() is None
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} >= {
        template.pid, a.proc.pid, b.proc.pid}  # this process's descendants: Spawned finds them


def test_the_exit_of_each_fork_is_reported_with_its_code(template):
    a, b = template.take(), template.take()
    a.request("stop", timeout=10)
    assert a.proc.wait(10) == 3
    os.kill(b.proc.pid, signal.SIGKILL)
    assert b.proc.wait(10) == -signal.SIGKILL and b.proc.poll() == -signal.SIGKILL


def test_an_agent_outlives_a_closed_template_and_ends_at_its_own_stdins_end(template):
    a = template.take()
    template.close()
    assert template.proc.poll() is not None and not template.usable()
    assert template.take() is None
    assert a.proc.poll() is None and a.request("ping", timeout=10)["pong"] == a.proc.pid
    a.proc.stdin.close()  # what a kernel's exit does: the agent ends by itself
    assert _wait(lambda: a.proc.poll() is not None)
    assert a.proc.poll() == ForkedAgentProc.UNKNOWN  # its template could not say how


def test_a_template_from_another_environment_forks_nothing(template, monkeypatch):
    monkeypatch.setenv("TORCH_TEST_CHANGED", "1")  # read when torch loads: a different set-up
    assert not template.usable() and template.take() is None
    assert psutil.Process(template.pid).children() == []


def test_a_template_whose_kernel_ends_ends_with_it():
    code = ("import sys, time\nfrom dpnb.cluster.zygote import WarmZygote\n"
            f"w = WarmZygote([sys.executable, '-c', {STAND_IN!r}])\n"
            "assert w.wait_ready(30)\nprint(w.pid, flush=True)\n")
    import subprocess

    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout)
    assert _wait(lambda: not psutil.pid_exists(pid) or
                 psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
