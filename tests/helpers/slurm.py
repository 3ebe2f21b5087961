"""A Slurm cluster on this machine for the multi-host tier: munged, slurmctld, one slurmd per host.

slurmctld runs here (on the hosts' bridge address); each :class:`Host` of
:mod:`helpers.hosts` runs a slurmd in its namespaces, with its hostname as
the node name.  Everything lives in a temporary folder with its own munge
key, ports, state and logs; :meth:`SlurmCluster.close` cancels every job,
stops the daemons and removes the folder.  Nothing here talks to any other
Slurm: commands get ``SLURM_CONF`` pointing at this one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import shutil
import signal
import subprocess
import time

import psutil

from .hosts import Hosts, TornDownOnFailure


_CGROUP_V1 = ("mount -t tmpfs none /sys/fs/cgroup && for c in freezer cpuset memory devices "
              "cpuacct cpu; do mkdir -p /sys/fs/cgroup/$c && "
              "mount -t cgroup -o $c none /sys/fs/cgroup/$c; done")


def missing() -> str | None:
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install slurm-wlm munge)"
    return None


class SlurmCluster(TornDownOnFailure):
    def __init__(self, hs: Hosts, port: int = 16817):
        self.hs = hs
        self.dir = os.path.join(hs.dir, "slurm")
        os.makedirs(self.dir, exist_ok=True)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.procs: list[subprocess.Popen] = []
        self.port = port

    def _daemon(self, cmd: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(self.dir, log), "w"),  # noqa: SIM115
                             env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def _up(self) -> None:
        d = self.dir
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(d, "munge.sock")
        self._daemon(["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                      f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                      f"--seed-file={d}/munged.seed"], "munged.err")
        # room for a replacement job beside a running one (a killed task's CPU
        # stays with its job); slurmd takes the configured count as given
        cpus = 4 * (os.cpu_count() or 2)
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.ip} CPUs={cpus} State=UNKNOWN\n"
                        for h in self.hs.hosts)
        names = ",".join(h.name for h in self.hs.hosts)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=dpnbtest
SlurmctldHost={socket.gethostname()}({self.hs.bridge_ip})
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SchedulerType=sched/backfill
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
SlurmdParameters=config_overrides
{nodes}PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        os.makedirs(os.path.join(d, "state"), exist_ok=True)
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        for h in self.hs.hosts:
            os.makedirs(os.path.join(d, f"spool-{h.name}"), exist_ok=True)
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        self._daemon(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.err")
        for h in self.hs.hosts:
            # slurmd in the host's network, with its hostname (its node name)
            # and cgroup v1 hierarchies of its own (slurmd 22.05 insists on a
            # cgroup plugin even with proctrack/linuxproc and task/none)
            self._daemon(["ip", "netns", "exec", h.ns, "unshare", "--uts", "--mount", "sh", "-c",
                          f"{_CGROUP_V1} && hostname {h.name} && "
                          f"exec slurmd -D -f {self.conf}"],
                         f"slurmd-{h.name}.err")
        deadline = time.monotonic() + 30
        while True:
            out = self.run("sinfo", "-h", "-o", "%T").stdout.split()
            if out and all(s.startswith("idle") for s in out):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm nodes not idle: {out}\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".log", ".err")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f"--- {name}\n" + "\n".join(f.read().splitlines()[-25:]))
        return "\n".join(out)

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env,
                              timeout=30, check=False)

    def jobs(self) -> list[str]:
        return [j for j in self.run("squeue", "-h", "-o", "%i %T").stdout.splitlines() if j]

    def _strays(self) -> list:
        """Processes this cluster's slurmds started that outlived them (job steps'
        slurmstepd daemonize and leave slurmd's session): known by the unique
        SLURM_CONF they inherited, held as psutil objects (PID and start time)."""
        out = []
        mine = {p.pid for p in self.procs}
        # the raw bytes: slurmstepd writes its title over the start of its
        # environment, so a parsed environment can lose the first variable
        mark = b"SLURM_CONF=" + self.conf.encode() + b"\0"
        for q in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                with open(f"/proc/{q.pid}/environ", "rb") as f:
                    if q.pid not in mine and mark in f.read():
                        out.append(q)
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--user=root")
            deadline = time.monotonic() + 15  # let the steps end before their slurmd goes
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        strays = self._strays()
        for q in strays:
            with contextlib.suppress(psutil.Error):
                q.terminate()
        _, alive = psutil.wait_procs(strays, timeout=5)
        for q in alive:
            with contextlib.suppress(psutil.Error):
                q.kill()
