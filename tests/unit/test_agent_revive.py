"""A host whose agent's connection ended (a cut link): the next restart opens a
new agent there, which first ends what the old one left running (its records,
by PID and start time); a host that still does not answer is said in one
line.  The whole flow across two namespace hosts: tests/multihost/test_cut_link.py."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from dpnb.cluster.agents import Agents, HostAgent
from dpnb.errors import DpnbError
from dpnb.engine import agentrecords


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setattr(agentrecords.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _record(cluster, agent, engines, host=None):
    folder = agentrecords.folder()
    host = host or socket.gethostname()
    with open(os.path.join(folder, f"{cluster}.{host}.{agent.pid}"), "w") as f:
        json.dump({"agent": [agent.pid, agentrecords.start_time(agent.pid)],
                   "engines": [[p.pid, agentrecords.start_time(p.pid)] for p in engines]}, f)


def test_a_new_agent_ends_the_stale_agent_of_its_cluster_and_nothing_else(records):
    stale, engine, other, recycled, elsewhere = (_sleeper() for _ in range(5))
    here = socket.gethostname()
    try:
        _record("c1", stale, [engine])
        _record("c2", other, [])  # another cluster's agent on this host
        _record("c1", elsewhere, [], host="other-host")  # a host sharing this /tmp
        with open(os.path.join(agentrecords.folder(), f"c1.{here}.{recycled.pid + 10**6}"),
                  "w") as f:
            json.dump({"agent": [recycled.pid, 1], "engines": []}, f)  # same PID, not that process
        me = agentrecords.Record("c1")
        assert sorted(me.supersede()) == sorted([stale.pid, engine.pid])
        assert stale.wait(5) == -9 and engine.wait(5) == -9
        assert other.poll() is None and recycled.poll() is None and elsewhere.poll() is None
        assert sorted(os.listdir(agentrecords.folder())) == sorted(
            [f"c2.{here}.{other.pid}", f"c1.other-host.{elsewhere.pid}"])
        me.write([])
        assert f"c1.{here}.{os.getpid()}" in os.listdir(agentrecords.folder())
        me.remove()
    finally:
        for p in (stale, engine, other, recycled, elsewhere):
            p.kill()
            p.wait()


def test_a_records_folder_another_user_could_write_is_not_used(records):
    os.makedirs(os.path.join(records, f"dpnb-agents-{os.getuid()}"), mode=0o777)
    os.chmod(os.path.join(records, f"dpnb-agents-{os.getuid()}"), 0o777)
    assert agentrecords.folder() is None
    assert agentrecords.Record("c1").supersede() == []


class _Local(Agents):
    """Agents whose 'ssh' is this host: a plain (torch-free) agent per host, or a
    command that fails as ssh to an unreachable host does."""

    EXIT_ON, ENDED = "", "the ssh connection to {host} ended"
    unreachable = False

    def _agent(self, h, warm):
        if self.unreachable:
            return HostAgent(h, [sys.executable, "-c", "import sys; sys.stderr.write("
                                 "'ssh: connect to host b port 22: Connection timed out\\n'); "
                                 "sys.exit(255)"])
        return HostAgent(h, [sys.executable, "-m", "dpnb.engine.hostagent"])


def test_a_restart_opens_a_new_agent_where_the_connection_ended(records):
    agents = _Local({"b": 1}, remote_python=sys.executable, ssh_config=None, env={})
    agents.open()
    try:
        agents.hello("{}", "cluster-1")
        first = agents.agents["b"]
        agents.revive("b")  # still connected: nothing to do
        assert agents.agents["b"] is first
        first.proc.kill()
        first.proc.wait(5)
        agents.revive("b")
        assert agents.agents["b"] is not first and agents.agents["b"].proc.poll() is None
        assert agents.agents["b"].request("ping")["pong"]
    finally:
        agents.close()


def test_a_host_that_still_does_not_answer_is_said_in_one_line(records):
    agents = _Local({"b": 1}, remote_python=sys.executable, ssh_config=None, env={})
    agents.open()
    try:
        agents.hello("{}", "cluster-1")
        first = agents.agents["b"]
        first.proc.kill()
        first.proc.wait(5)
        agents.unreachable = True
        t = time.monotonic()
        with pytest.raises(DpnbError) as ei:
            agents.start({"b": 1})
        msg = str(ei.value)
        assert time.monotonic() - t < 10
        assert "\n" not in msg and msg.startswith("host b does not answer")
        assert "Connection timed out" in msg and "%dp restart again" in msg, msg
        assert agents.agents["b"] is first  # the next restart tries again
    finally:
        agents.close()
