"""Two (or more) "hosts" on this machine, for the multi-host tier.

Each host is a network namespace with its own hostname (``unshare --uts``)
and its own PID namespace (``unshare --pid``), joined to the test's bridge by
a veth pair, with an sshd listening on its address.  Nothing about it is
faked for dpnb: the hostname does not resolve (like a node whose name is not
in this machine's /etc/hosts), remote PIDs are numbers in another PID
namespace (a local ``kill`` of them would hit something else), and the
remote non-interactive PATH has no dpnb (``python3`` there is the system
one).

Network rule: every address is inside namespaces made here; the bridge has
no route anywhere else.  Cleanup (bridge, namespaces, daemons, keys) runs on
exit, also when a test fails: killing a host's PID-namespace init kills every
process that ran there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

SSHD = "/usr/sbin/sshd"

# PID 1 of a host's PID namespace: set the hostname, run sshd, reap orphans
# (engines started over ssh are daemonised and reparent to it).
_INIT = r"""
import os, socket, subprocess, sys
socket.sethostname(sys.argv[1])
sshd = subprocess.Popen(sys.argv[2:])
while True:
    pid, _ = os.wait()
    if pid == sshd.pid:
        sys.exit(0)
"""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if _ppid(int(p)) == pid:
                    out.append(int(p))
    return out


def _ancestor_in(pid: int, ancestors: set[int]) -> bool:
    for _ in range(50):
        try:
            pid = _ppid(pid)
        except OSError:
            return False
        if pid in ancestors:
            return True
        if pid <= 1:
            return False
    return False


def remote_python() -> str:
    """``--remote-python`` that runs this checkout's dpnb on a host: over ssh the
    agent starts in the remote home with no PYTHONPATH, so this machine's
    Python would import the editable install's dpnb -- another worktree's code,
    not the one under test (a break in an engine module would go unseen)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return f"env PYTHONPATH={repo} {sys.executable}"


def missing() -> str | None:
    """Why the multi-host tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", SSHD):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install openssh-server openssh-client iproute2)"
    return None


def _sh(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=timeout)


@dataclass
class Host:
    name: str        # its hostname (unresolvable on purpose)
    ns: str          # its network namespace
    ip: str          # its address on the bridge
    veth: str        # the bridge-side end of its veth pair
    ifname: str      # the interface name inside the host
    init: subprocess.Popen | None = None

    def run(self, *cmd: str, timeout: float = 20) -> subprocess.CompletedProcess:
        """Run a command in this host's network namespace (not its PID namespace)."""
        return _sh("ip", "netns", "exec", self.ns, *cmd, check=False, timeout=timeout)


class TornDownOnFailure:
    """``with X(...) as x``: ``_up()`` on entry, ``close()`` on exit -- and on an
    entry that fails part-way, so a half-built harness leaves nothing behind."""

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Hosts(TornDownOnFailure):
    """A bridge with ``n`` hosts; ``ssh_config`` reaches each by its hostname."""

    n: int = 2
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 100)
    hosts: list[Host] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])

    def __post_init__(self):
        self.dir = tempfile.mkdtemp(prefix="dpnb-hosts-")
        self.bridge = f"dpbr{self.tag}"
        self.bridge_ip = f"10.77.{self.subnet}.1"
        self.ssh_config = os.path.join(self.dir, "ssh_config")

    # ------------------------------------------------------------- bring-up
    def _up(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        key = os.path.join(self.dir, "id_ed25519")
        hostkey = os.path.join(self.dir, "host_ed25519")
        for k in (key, hostkey):
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k)
        shutil.copy(key + ".pub", os.path.join(self.dir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation dir
        conf = []
        for i in range(self.n):
            h = Host(name=f"node{i}-{self.tag}", ns=f"dpns{self.tag}{i}",
                     ip=f"10.77.{self.subnet}.{i + 2}", veth=f"dpv{self.tag}{i}", ifname="eth1")
            self.hosts.append(h)
            _sh("ip", "netns", "add", h.ns)
            _sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.veth + "p")
            _sh("ip", "link", "set", h.veth + "p", "netns", h.ns)
            _sh("ip", "link", "set", h.veth, "master", self.bridge)
            _sh("ip", "link", "set", h.veth, "up")
            for cmd in (("ip", "link", "set", h.veth + "p", "name", h.ifname),
                        ("ip", "addr", "add", f"{h.ip}/24", "dev", h.ifname),
                        ("ip", "link", "set", h.ifname, "up"),
                        ("ip", "link", "set", "lo", "up")):
                _sh("ip", "netns", "exec", h.ns, *cmd)
            sshd_conf = os.path.join(self.dir, f"sshd_{i}")
            with open(sshd_conf, "w") as f:
                f.write(f"ListenAddress {h.ip}\nPort 22\nHostKey {hostkey}\n"
                        f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin yes\n"
                        "PasswordAuthentication no\nUsePAM no\nStrictModes no\n"
                        f"PidFile {self.dir}/sshd_{i}.pid\nMaxStartups 100:30:200\n"
                        "MaxSessions 100\nLogLevel ERROR\nSubsystem sftp internal-sftp\n")
            h.init = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "--uts", "--pid", "--fork",
                 "--mount-proc", "/usr/bin/python3", "-c", _INIT, h.name,
                 SSHD, "-D", "-e", "-f", sshd_conf],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.dir, f"sshd_{i}.log"), "w"),
                start_new_session=True)
            conf.append(f"Host {h.name}\n  HostName {h.ip}\n")
        conf.append(f"Host *\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
                    f"  UserKnownHostsFile {self.dir}/known_hosts\n"
                    "  StrictHostKeyChecking accept-new\n  BatchMode yes\n"
                    "  ConnectTimeout 10\n  LogLevel ERROR\n")
        with open(self.ssh_config, "w") as f:
            f.write("".join(conf))
        for h in self.hosts:
            self._wait_port(h.ip, 22)

    @staticmethod
    def _wait_port(ip: str, port: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((ip, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {ip} did not start")
                time.sleep(0.1)

    # ------------------------------------------------------------- helpers
    def ssh(self, host: Host, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return _sh("ssh", "-F", self.ssh_config, host.name, command, check=False,
                   timeout=timeout)

    def throttle(self, rate: str = "1gbit") -> None:
        """Limit every host's link to ``rate`` both ways (tbf; netem is not available)."""
        for h in self.hosts:
            for cmd in (("tc", "qdisc", "replace", "dev", h.veth, "root", "tbf", "rate", rate,
                         "burst", "256kb", "latency", "50ms"),):
                _sh(*cmd)
            _sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev", h.ifname, "root",
                "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")

    def remote_pids(self, host: Host) -> list[int]:
        """PIDs (as seen from this machine) of what runs in ``host`` besides its
        init and sshd listener: engines, agents, ssh sessions."""
        if host.init is None:
            return []
        init = _children(host.init.pid)
        base = set(init) | {p for i in init for p in _children(i)}  # init, sshd listener
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in base:
                continue
            with contextlib.suppress(OSError):
                if _ancestor_in(int(pid), set(init)):
                    out.append(int(pid))
        return out

    def outer_pid(self, host: Host, inner: int) -> int:
        """The PID, as seen from this machine, of what runs as ``inner`` in ``host``'s
        PID namespace (a rank table's PID): /proc's NSpid lists it outermost first."""
        for pid in self.remote_pids(host):
            try:
                with open(f"/proc/{pid}/status") as f:
                    ns = next(ln.split()[1:] for ln in f if ln.startswith("NSpid:"))
            except OSError:  # ended meanwhile
                continue
            if int(ns[-1]) == inner:
                return pid
        raise LookupError(f"no process {inner} in {host.name}")

    # ------------------------------------------------------------- cleanup
    def close(self) -> None:
        for h in self.hosts:
            if h.init is not None and h.init.poll() is None:
                # SIGKILL the unshare and its namespace's init: the kernel then
                # kills every process in that PID namespace.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(h.init.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.init.wait(10)
            _sh("ip", "link", "del", h.veth, check=False)
            _sh("ip", "netns", "del", h.ns, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def hosts_or_skip(n: int, tier: str):
    """``n`` hosts for a module's fixture, or a skip that says why not here."""
    import pytest

    why = missing()
    if why:
        pytest.skip(f"{tier}: {why}")
    with Hosts(n) as hs:
        yield hs
