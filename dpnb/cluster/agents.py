"""Engines on other hosts over ssh: one host agent per host, one ssh connection each.

``%dp start --engines ssh --launcher-arg node1=4 --launcher-arg node2=4``
opens one ``ssh node1 PYTHON -m dpnb.engine.hostagent`` per host (in
parallel) and keeps it for the cluster's life.  Over that connection the
notebook sends the controller's connection info and the engines'
environment, asks for engines, signals them and stops them; the agent
reports each engine's exit as it happens.  See :mod:`dpnb.engine.hostagent`.

Why not ipyparallel's ssh launcher: it runs five or more ssh commands per
engine, one after another (start took 20 s for four engines), shows none of
the remote stderr when the remote Python lacks ipyparallel, keeps a profile
folder on each host, and a SIGKILLed kernel leaves the remote engines
running.  Here a host costs one ssh handshake; the remote stderr is read
and shown; nothing is written on the host outside a temporary folder the
agent removes; and when the kernel dies its ssh clients see end of input,
so the agents stop their engines.  PIDs the agents report are PIDs on their
host: they are only ever signalled through that host's agent.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from dpnb.engine import entrypoints as ep
from dpnb.engine.boot import wait_for_connection
from ..errors import DpnbError, StartError
from .processes import describe_exit
from .registration import wait_registered

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 30.0
#: an agent answers "start" after forking or spawning its n engines one by one,
#: while the first ones already boot on the same cores: 30 s did not cover 128
#: on a 2-core host, so the wait grows with n
START_S_PER_ENGINE = 0.5
#: what an ssh agent that is a zygote may add to its first answer: its imports
ZYGOTE_IMPORT_S = 60.0
#: an agent answers a states request at once; a wait asks about once a second
STATES_TIMEOUT_S = 2.0


def parse_hosts(n: int, launcher_args: Sequence[str] | None) -> dict[str, int]:
    """``["node1=2", "node2=2"]`` -> ``{"node1": 2, "node2": 2}``, checked against ``-n``."""
    if not launcher_args:
        raise DpnbError("--engines ssh needs the hosts: --launcher-arg HOST=N for each host "
                        "(e.g. --launcher-arg node1=2 --launcher-arg node2=2)")
    hosts: dict[str, int] = {}
    for a in launcher_args:
        host, sep, count = a.partition("=")
        host = host.strip()
        try:
            k = int(count)
        except ValueError:
            k = -1
        if not sep or not host or k < 1:
            raise DpnbError(f"--launcher-arg {a!r}: for ssh give HOST=N (N >= 1 engines on HOST)")
        if host in hosts:
            raise DpnbError(f"--launcher-arg names {host} twice: give each host once, HOST=N")
        hosts[host] = k
    total = sum(hosts.values())
    if total != n:
        per = " + ".join(f"{k} on {h}" for h, k in hosts.items())
        raise DpnbError(f"-n {n} but the hosts take {total} engines ({per}): make -n {total} "
                        f"or change the HOST=N counts")
    return hosts


def ssh_command(ssh_config: str | None) -> list[str]:
    """ssh without prompts, noticing a dead link within ~15 s, and saying so: its
    "Timeout, server ... not responding." is logged at INFO, which a config's
    ``LogLevel ERROR`` would hide -- the words that name a cut link."""
    cmd = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
           "-o", "ServerAliveCountMax=3", "-o", "ConnectTimeout=15", "-o", "LogLevel=INFO"]
    if ssh_config:
        cmd[1:1] = ["-F", ssh_config]
    return cmd


def resolve(host: str, ssh_config: str | None) -> str:
    """The address ssh would connect to for ``host`` (its ``HostName``, resolved)."""
    try:
        out = subprocess.run([*ssh_command(ssh_config), "-G", host], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        name = next((ln.split(None, 1)[1] for ln in out.splitlines()
                     if ln.startswith("hostname ")), host)
    except (OSError, subprocess.SubprocessError) as e:
        log.info("ssh -G %s failed (%s); using the name as given", host, e)
        name = host
    try:
        return socket.getaddrinfo(name, 22, proto=socket.IPPROTO_TCP)[0][4][0]
    except OSError as e:
        raise DpnbError(f"host {host!r} does not resolve ({e}): give an address or a name "
                        f"your ssh config knows") from None


class HostAgent:
    """One host's agent: its ssh process, replies by id, exits as they come."""

    def __init__(self, host: str, cmd: list[str], proc=None):
        """``proc``: an agent already running (a fork of the kernel's zygote
        template, :class:`dpnb.cluster.zygote.ForkedAgentProc`); else ``cmd`` starts one."""
        self.host = host
        self.cmd = cmd
        self.proc = proc or subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, bufsize=1,
                                             start_new_session=True)
        self.replies: dict[int, queue.Queue] = {}
        self.exits: dict[int, dict] = {}  # engine pid -> {"code", "tail"}
        self.err = collections.deque(maxlen=40)
        self.lock = threading.Lock()
        self.next_id = 0
        threading.Thread(target=self._read, name=f"dpnb-agent-{host}", daemon=True).start()
        threading.Thread(target=self._read_err, name=f"dpnb-agent-err-{host}",
                         daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self.err.append(line.rstrip())
                continue
            if msg.get("event") == "exit":
                self.exits[int(msg["pid"])] = msg
                log.info("%s: engine pid %s exited (%s)", self.host, msg["pid"], msg.get("code"))
            elif msg.get("id") in self.replies:
                self.replies[msg["id"]].put(msg)
        for q in list(self.replies.values()):
            q.put(None)  # the connection is gone: wake every waiter

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line.rstrip())

    def stderr_tail(self, lines: int = 8) -> str:
        return "\n".join(list(self.err)[-lines:])

    def request(self, cmd: str, timeout: float = REPLY_TIMEOUT_S, **fields) -> dict:
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            q: queue.Queue = queue.Queue()
            self.replies[rid] = q
        try:
            try:
                self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **fields}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return self._gone(cmd)
            if self.proc.poll() is not None and q.empty():
                return self._gone(cmd)
            try:
                msg = q.get(timeout=timeout)
            except queue.Empty:
                raise StartError(f"host {self.host}: the dpnb host agent did not answer "
                                 f"{cmd!r} within {timeout:.0f} s{self._stderr_note()}") from None
            if msg is None:
                return self._gone(cmd)
            if not msg.get("ok"):
                raise DpnbError(f"host {self.host}: {cmd} failed: {msg.get('error')}")
            return msg
        finally:
            self.replies.pop(rid, None)

    def _stderr_note(self) -> str:
        tail = self.stderr_tail()
        return f"; its stderr ended with:\n{tail}" if tail else ""

    def _gone(self, cmd: str):
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.05)  # let the stderr reader take the last lines
        raise StartError(
            f"host {self.host}: `{' '.join(self.cmd[-3:])}` ended (exit {code}) before it "
            f"answered {cmd!r}{self._stderr_note()}\n"
            f"If the module is missing there, point --remote-python at a Python on {self.host} "
            f"that has dpnb installed (e.g. --remote-python /path/to/venv/bin/python); if ssh "
            f"failed, check `ssh {self.host}` works without a password prompt")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the agent's engines, end the ssh connection; kill ssh if it hangs."""
        if self.proc.poll() is None:
            try:
                self.request("stop", timeout=timeout)
            except (DpnbError, StartError) as e:
                log.warning("host %s: agent stop: %s", self.host, e)
        try:
            self.proc.stdin.close()
        except OSError as e:  # ssh already gone: the wait below returns at once
            log.debug("host %s: agent stdin: %s", self.host, e)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("host %s: ssh did not end; killing it", self.host)
            self.proc.kill()
            self.proc.wait(5)


class Agents:
    """The cluster's host agents, keyed by the host name given to ``--launcher-arg``:
    one per host, reached over ssh (:class:`dpnb.cluster.launchers.local.ZygoteAgent`:
    the one on this host)."""

    def __init__(self, hosts: dict[str, int], *, remote_python: str,
                 ssh_config: str | None, env: dict[str, str], zygote: str = "off"):
        self.connection, self.cluster = "", ""  # what hello handed the agents (revive's too)
        self.counts = dict(hosts)
        self.zygote = zygote  # launch.host_zygote_for: "on", "auto" or "off"
        self.remote_python = remote_python
        self.ssh_config = ssh_config
        self.env = dict(env)
        self.agents: dict[str, HostAgent] = {}

    #: how an engine's exit, and the agent's own end, are spoken of
    EXIT_ON, ENDED = " on {host}", "the ssh connection to {host} ended"

    def _agent(self, h: str, warm) -> HostAgent:
        flag = {"on": ["--zygote"], "auto": ["--zygote-auto"]}.get(self.zygote, [])
        return HostAgent(h, [*ssh_command(self.ssh_config), h, self.remote_python, "-m",
                             ep.HOSTAGENT_MODULE, *flag])

    def _environ(self) -> dict[str, str] | None:
        return None  # an ssh host's engines keep their own environment (and get ``env``)

    def _parallel(self, fn, hosts: Iterable[str]) -> dict:
        hosts = list(hosts)
        with ThreadPoolExecutor(max(1, len(hosts))) as pool:
            futs = {h: pool.submit(fn, h) for h in hosts}
        errors = []
        out = {}
        for h, f in futs.items():
            try:
                out[h] = f.result()
            except (DpnbError, StartError) as e:
                errors.append(str(e))
        if errors:
            raise StartError("\n".join(errors))
        return out

    def open(self, warm=None) -> None:
        """Start one agent per host over ssh, in parallel (or take the warm zygote)."""
        for h in self.counts:
            self.agents[h] = self._agent(h, warm)

    def hello(self, connection: str, cluster: str = "") -> dict[str, dict]:
        """Hand every agent the controller's connection info and the cluster's id
        (kept for :meth:`revive`); check versions agree."""
        self.connection, self.cluster = connection, cluster
        info = self._parallel(self._hello, self.agents)
        _check_versions(info)
        for h, i in info.items():  # "auto" is decided there: say what each host chose
            log.info("host %s: engines %s", h, "forked from its agent (zygote)"
                     if i.get("zygote") else "started as one Python each")
        return info

    def _hello(self, h: str) -> dict:
        env = {**self.env, "DPNB_LOCATION": h}
        # a zygote answers once it has imported torch (seconds; more on a loaded host)
        wait = REPLY_TIMEOUT_S + (ZYGOTE_IMPORT_S if self.zygote != "off" else 0.0)
        return self.agents[h].request("hello", timeout=wait, connection=self.connection, env=env,
                                      environ=self._environ(), cluster=self.cluster)

    def revive(self, h: str) -> None:
        """A new agent for host ``h`` if the old one's connection ended (a cut
        link, a rebooted host), so its ranks can be replaced there: the new agent
        first ends what the old one left running there (agentrecords).  A host
        that still does not answer is said in one line."""
        old = self.agents.get(h)
        if old is None or old.proc.poll() is None:
            return
        lost = self.ENDED.format(host=h) + _last_words(old)
        new = self.agents[h] = self._agent(h, None)
        try:
            info = self._hello(h)
        except (DpnbError, StartError) as e:
            new.close(timeout=2)
            self.agents[h] = old  # its exits stay readable; the next restart tries again
            said = new.stderr_tail(1).strip() or (str(e).strip().splitlines() or [""])[0]
            raise StartError(
                f"host {h} does not answer ({lost}; a new connection failed too: {said}): "
                f"its ranks can be replaced there once it answers -- %dp restart again then; "
                f"the ranks on the other hosts keep their state") from None
        log.info("host %s: a new agent after %s%s", h, lost,
                 f"; it ended what the old one left running (pids {info['superseded']})"
                 if info.get("superseded") else "")

    def start(self, counts: dict[str, int]) -> dict[str, list[int]]:
        def one(h):
            wait = REPLY_TIMEOUT_S + START_S_PER_ENGINE * counts[h]
            return self.agents[h].request("start", timeout=wait, n=counts[h])["pids"]

        hosts = [h for h in counts if counts[h] > 0]
        for h in hosts:
            self.revive(h)
        return self._parallel(one, hosts)

    def failures(self, started: dict[str, list[int]] | None = None) -> list[str]:
        """Engines of ``started`` (default: all) that exited, with their last lines,
        and agents whose connection ended (for start errors)."""
        out = []
        for h, a in self.agents.items():
            for pid, e in a.exits.items():
                if started is not None and pid not in started.get(h, ()):
                    continue
                out.append(f"{h}: engine pid {pid} exited with code {e.get('code')}:\n"
                           f"{e.get('tail', '')}")
            if a.proc.poll() is not None:
                out.append(f"{h}: the ssh connection to the agent ended{a._stderr_note()}")
        return out

    def exit_of(self, host: str, pid: int) -> str | None:
        """How an engine on ``host`` ended (as its agent saw), or None while it runs."""
        a = self.agents.get(host)
        if a is None:
            return "its host agent is unknown"
        e = a.exits.get(pid)
        if e is not None:
            return describe_exit(e.get("code")) + self.EXIT_ON.format(host=host)
        if a.proc.poll() is not None:
            return self.ENDED.format(host=host) + _last_words(a)
        return None

    def states(self, host: str, pids: list[int]) -> dict[int, str]:
        """Which of ``pids`` on ``host`` are frozen, as its agent reads them (psutil's
        words: "stopped", "tracing-stop"); {} when the agent cannot say."""
        a = self.agents.get(host)
        if a is None or a.proc.poll() is not None:
            return {}
        try:
            got = a.request("states", pids=list(pids), timeout=STATES_TIMEOUT_S).get("states", {})
        except (DpnbError, StartError) as e:
            log.info("frozen states on %s not read: %s", host, e)
            return {}
        return {int(k): str(v) for k, v in got.items()}

    def signal(self, host: str, pid: int, sig: int) -> bool:
        a = self.agents.get(host)
        if a is None or a.proc.poll() is not None:
            return False
        try:
            return bool(a.request("signal", pid=pid, sig=int(sig), timeout=10).get("sent"))
        except (DpnbError, StartError) as e:
            log.warning("signal %s to %s on %s: %s", sig, pid, host, e)
            return False

    def local_pids(self) -> list[int]:
        """The ssh client processes on this host (the reaper may stop them)."""
        return [a.proc.pid for a in self.agents.values() if a.proc.poll() is None]

    def close(self) -> None:
        """Stop every host's engines and agent, all hosts at once.

        Plain threads, not an executor: this also runs from ``atexit`` (a
        kernel exiting), when executors refuse new work."""
        threads = [threading.Thread(target=a.close, name=f"dpnb-close-{h}", daemon=True)
                   for h, a in self.agents.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _last_words(a: HostAgent) -> str:
    """What the ended connection said last (ssh: "Timeout, server ... not
    responding." for a cut link), as ": ..." -- or nothing."""
    tail = a.stderr_tail(1).strip()
    return f": {tail}" if tail else ""


def _check_versions(info: dict[str, dict]) -> None:
    """Every host must run the same torch and dpnb: gloo/NCCL wire formats and
    dpnb's engine calls differ between versions."""
    for mod in ("torch", "dpnb"):
        seen = {h: i.get("versions", {}).get(mod) for h, i in info.items()}
        missing = [h for h, v in seen.items() if v is None]
        if missing:
            raise StartError(f"{mod} is not installed for {info[missing[0]].get('python')} on "
                             f"{', '.join(missing)}: install it there, or point --remote-python "
                             f"at a Python that has it")
        if len(set(seen.values())) > 1:
            per = ", ".join(f"{h}: {v}" for h, v in seen.items())
            raise StartError(f"hosts run different {mod} versions ({per}): install the same "
                             f"version everywhere")


def wait_file(path: str, timeout: float) -> str:
    """The controller's engine connection file, once written."""

    text = wait_for_connection(path, timeout)
    if text is None:
        raise StartError(f"the controller wrote no connection file ({path}) within {timeout:.0f} s")
    return text


def engine_connection_file(icluster) -> str:
    return os.path.join(icluster.profile_dir, "security",
                        f"ipcontroller-{icluster.cluster_id}-engine.json")


def start_over_ssh(icluster, n: int, spec, timeout: float):
    """The ssh start: agents and controller at once, then every host's engines.

    The agents' ssh handshakes run while the controller starts; a host whose
    agent cannot start (no dpnb for that Python, ssh refused) fails the start
    with that host's stderr, before any engine is launched.
    """
    agents = Agents(parse_hosts(n, spec.launcher_args), remote_python=spec.remote_python or "python3",
                    ssh_config=spec.ssh_config, env=spec.env_dict, zygote=spec.host_zygote)
    return start_with(agents, icluster, n, timeout)


def start_with(agents: Agents, icluster, n: int, timeout: float, warm=None):
    """Agents and controller at once, then every agent's engines, registered."""
    try:
        agents.open(warm)
        icluster.start_controller_sync()
        agents.hello(wait_file(engine_connection_file(icluster), timeout), icluster.cluster_id)
        started = agents.start(agents.counts)
        client = icluster.connect_client_sync()
        client = wait_registered(icluster, client, n, timeout, lambda: agents.failures(started),
                                 _unreachable(client))
        return client, agents
    except BaseException:
        agents.close()
        raise


#: the host name a zygote cluster's one agent is known by (ranks' ``location``)
ZYGOTE_HOST = "localhost"


#: environment variables read while torch (and its libraries) load: a zygote
#: started with other values imported a different torch set-up
_IMPORT_TIME = ("TORCH", "PYTORCH", "CUDA", "NCCL", "GLOO", "OMP_", "MKL", "KMP_", "LD_",
                "PYTHON", "NVIDIA", "CUBLAS", "CUDNN")


#: ... except these, which torch sets in the kernel's own environment on first
#: use (inductor's cache folder, after a cell that trained in the notebook)
#: and reads only when it compiles; the engines get the kernel's environment
#: of the moment anyway (``hello``)
_NOT_IMPORT_TIME = ("TORCHINDUCTOR_CACHE_DIR",)


def import_time_keys(env: dict[str, str]) -> list[str]:
    """The keys of ``env`` that torch (or a library it loads) reads while it imports."""
    return sorted(k for k in env if k.startswith(_IMPORT_TIME) and k not in _NOT_IMPORT_TIME)


def import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_IMPORT_TIME) and k not in _NOT_IMPORT_TIME}


def _unreachable(client) -> str:
    return (f": can the hosts reach the controller at {client._config.get('interface', '?')}? "
            f"Give --controller-ip an address of this host they can reach")
