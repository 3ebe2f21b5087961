"""The host agent's answer to "which of my engines are frozen": it reads each
engine's state on its own host (the notebook cannot see another host's
processes), and names only engines it started."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dpnb.engine.hostagent import Agent


@pytest.fixture
def agent():
    a = Agent(io.StringIO())
    yield a
    shutil.rmtree(a.dir, ignore_errors=True)


def _state_is(agent: Agent, pid: int, want: str | None, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if agent.states({"pids": [pid]})["states"].get(str(pid)) == want:
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_engine_is_named_stopped_and_running_again_after_sigcont(agent):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        agent.procs[p.pid] = p
        assert agent.states({"pids": [p.pid]}) == {"states": {}}
        os.kill(p.pid, signal.SIGSTOP)
        assert _state_is(agent, p.pid, "stopped")
        os.kill(p.pid, signal.SIGCONT)
        assert _state_is(agent, p.pid, None)
    finally:
        p.kill()
        p.wait()


def test_a_process_the_agent_did_not_start_is_not_read(agent):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert agent.states({"pids": [p.pid, os.getpid()]}) == {"states": {}}
    finally:
        p.kill()
        p.wait()


def test_zygote_auto_forks_only_where_no_nvidia_driver_is(tmp_path):
    from dpnb.engine.hostagent import zygote_wanted

    ctl = tmp_path / "nvidiactl"
    assert zygote_wanted(["--zygote-auto"], str(ctl))  # a CPU host: fork
    ctl.touch()
    assert not zygote_wanted(["--zygote-auto"], str(ctl))  # a GPU host: one Python each
    assert zygote_wanted(["--zygote"], str(ctl))  # asked outright
    assert not zygote_wanted([], str(tmp_path / "absent"))
