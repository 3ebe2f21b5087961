"""The processes a cluster started on this host: who they are, how they ended, stopping them.

dpnb stops only what it started, by PID *and* start time (a PID can be
recycled), and only on this host: the controller and, for launchers that run
engines here (local, mpi), the engines and their children.  Engines on other
hosts (ssh, slurm) are stopped through ipyparallel and their launcher, never
by a PID that means something else on this machine.

A kernel that exits normally stops its cluster (atexit).  One that is
SIGKILLed runs no cleanup, so a small watcher (:mod:`dpnb._reaper`) started in
its own session holds the list of ``pid start_time`` lines and stops them
when the kernel is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import psutil  # a dependency of ipyparallel

from .types import RankInfo

if TYPE_CHECKING:  # pragma: no cover
    from .launchers import EngineLauncher

log = logging.getLogger(__name__)

#: launchers whose engine processes run on this host


#: process states of a rank that runs no code until someone continues it
FROZEN_STATES = {psutil.STATUS_STOPPED: "stopped (SIGSTOP, Ctrl-Z or a job-control stop)",
                 psutil.STATUS_TRACING_STOP: "held by a debugger (ptrace stop)"}


def frozen_state(pid: int) -> str | None:
    """How this host's process ``pid`` is frozen (stopped, held by a tracer), or None:
    it runs, sleeps, or is gone (a death is :meth:`Transport.find_dead`'s to say)."""
    try:
        return FROZEN_STATES.get(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.AccessDenied) as e:
        log.debug("state of %s not read: %s", pid, e)
        return None


#: where the cgroup file system is mounted (v2 unified, or v1's memory controller)
CGROUP_ROOT = "/sys/fs/cgroup"


def oom_counter(pid: int) -> str | None:
    """The file that counts OOM kills in this host's process ``pid``'s memory cgroup
    (v2 ``memory.events``, v1 ``memory.oom_control``; their ``oom_kill`` line), read
    while it runs: once it is dead its cgroup can no longer be found."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError as e:
        log.debug("cgroup of %s not read: %s", pid, e)
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            cand = os.path.join(CGROUP_ROOT, path.lstrip("/"), "memory.events")
        elif "memory" in controllers.split(","):
            cand = os.path.join(CGROUP_ROOT, "memory", path.lstrip("/"), "memory.oom_control")
        else:
            continue
        if os.path.exists(cand):
            return cand
    return None


def oom_kills(counter: str | None) -> int | None:
    """The ``oom_kill`` count in :func:`oom_counter`'s file (None: not known)."""
    if counter is None:
        return None
    try:
        with open(counter) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError) as e:
        log.debug("OOM count %s not read: %s", counter, e)
    return None


def json_records(directory: str):
    """``(path, record, error)`` for each ``*.json`` file of ``directory``, in name
    order: the record read, or the error that kept it from being read.  The folders
    of records processes leave for others -- a kernel's published cluster, a kept
    cluster -- are read this way, each dropping the stale ones by its own rule."""
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            path = os.path.join(directory, name)
            try:
                with open(path) as f:
                    yield path, json.load(f), None
            except (OSError, ValueError) as e:
                yield path, None, e


def remove_record(path: str, why: str) -> None:
    """Drop a stale record, saying why (in the log), and whether it could be removed."""
    log.info("%s: removing %s", why, path)
    try:
        os.remove(path)
    except OSError as e:
        log.info("could not remove %s: %s", path, e)


def describe_exit(code) -> str:
    """``exit code 3`` / ``killed by signal 9 (SIGKILL) (...)`` from a return code."""
    if code is None:
        return "process gone, exit status unknown"
    code = int(code)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        hint = " (killed: out of memory or kill -9?)" if -code == signal.SIGKILL else ""
        return f"killed by signal {-code} ({name}){hint}"
    return f"exit code {code}"


def local_exit(icluster, pid: int) -> str | None:
    """None while ``pid`` runs; else how it ended ("exit code 3", "killed by signal 9 ...")."""
    if not over(pid):
        return None
    code = None  # a process still ending: ipyparallel's waiter, joined below, reaps it
    for es in list(getattr(icluster, "engines", {}).values()):
        for el in list(getattr(es, "launchers", {}).values()):
            if getattr(el, "pid", None) == pid and getattr(el, "process", None) is not None:
                # ipyparallel's own waiter thread reaps the engine; a second
                # wait racing it gets None from psutil (and may overwrite the
                # code psutil caches), so let that thread finish and read its code
                waiter = getattr(el, "_wait_thread", None)
                if waiter is not None and waiter.is_alive():
                    waiter.join(2.0)
                try:
                    code = el.process.wait(0.5)
                except (psutil.Error, subprocess.TimeoutExpired) as e:
                    log.debug("exit status of pid %s not readable: %s", pid, e)
        stops = list((getattr(es, "stop_data", {}) or {}).get("engines", {}).values())
        for sd in stops:
            if sd.get("pid") == pid and sd.get("exit_code") is not None:
                code = sd["exit_code"]
    return describe_exit(code)


def start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started``."""
    now = start_time(pid)
    return now is not None and started is not None and abs(now - started) < 0.01


#: the kernel's per-task flag of an exit under way (``/proc/PID/stat`` field 9)
PF_EXITING = 0x4


def ended(pid: int, started: float) -> bool:
    """Whether the process that started at ``started`` as ``pid`` has ended or is
    ending: its PID taken by another, or :func:`over`."""
    return not same_process(pid, started) or over(pid)


def over(pid: int) -> bool:
    """Whether ``pid`` has ended or is ending: gone, a zombie its parent has not
    reaped yet, or killed and still tearing down (:func:`kill_under_way`)."""
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return True
    return ending(pid)


def ending(pid: int) -> bool:
    """Whether ``pid`` was killed and has not finished dying (:func:`kill_under_way`)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # gone meanwhile (the next look says so), or no /proc here
        return False
    return kill_under_way(status, stat)


def kill_under_way(status: str, stat: str) -> bool:
    """From a process's ``/proc/PID/status`` and ``/proc/PID/stat``: a SIGKILL is
    pending, or its exit has begun.

    Why: ``kill -9`` returns once the signal is queued; an engine holding
    hundreds of MB of torch takes milliseconds more to unmap them and become a
    zombie, and a restart asked in that moment would keep the dying rank."""
    bit = 1 << (signal.SIGKILL - 1)
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
            return True
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name: state, ppid, ...
    return len(fields) > 6 and bool(int(fields[6]) & PF_EXITING)


def engine_logs(icluster) -> str:
    """The last lines the engines printed (for start errors)."""
    try:
        text = "".join(es.get_output() or "" for es in icluster.engines.values())
    except (OSError, AttributeError, RuntimeError) as e:
        log.debug("engine output not readable: %s", e)
        return ""
    text = text.strip()
    return ("\nengine output:\n" + "\n".join(text.splitlines()[-15:])) if text else ""


def stop_ipp(icluster) -> None:
    """ipyparallel's own stop of the controller and every engine set."""
    try:
        icluster.stop_cluster_sync()
    except Exception as e:  # a half-started cluster can fail to stop; the PIDs are reaped below
        log.warning("ipyparallel stop_cluster failed: %s: %s", type(e).__name__, e)


def wait_pids_gone(procs: dict[int, float], timeout: float) -> None:
    """Wait for ``{pid: start_time}`` to exit; SIGKILL whatever outlives ``timeout``."""
    live = []
    for pid, started in procs.items():
        if same_process(pid, started):
            try:
                live.append(psutil.Process(pid))
            except psutil.Error as e:  # gone since the check: nothing to stop
                log.debug("pid %s: %s", pid, e)
    alive = _wait_exited(live, timeout)
    for p in alive:
        log.warning("pid %s outlived the stop by %.0f s: SIGKILL", p.pid, timeout)
        try:
            p.kill()
        except psutil.Error as e:
            log.debug("SIGKILL of %s: %s", p.pid, e)
    psutil.wait_procs(alive, timeout=5)


def _exited(p: psutil.Process) -> bool:
    """Whether ``p`` has ended.  A zombie has: it only waits to be reaped by
    its parent (for an engine's nanny, init, which took about a second here)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error as e:  # unreadable: treat it as running, the SIGKILL path decides
        log.debug("status of %s not readable: %s", p.pid, e)
        return False


def _wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (or is a zombie); those still running."""
    deadline = time.monotonic() + timeout
    live = list(procs)
    while True:
        # our own children among them (engines) are reaped by ipyparallel's
        # waiter threads; reaping here would race those for the exit code
        live = [p for p in live if not _exited(p)]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.02)


def terminate(owned: dict[int, float], keep: set) -> None:
    """SIGTERM every process of ``owned`` but ``keep`` (those that answer their
    own stop: the controller, host agents), all at once.

    The engines end at once (``dpnb.engine.setup`` makes SIGTERM exit
    fast); their ipyparallel nannies, which would otherwise outlive them
    by 1-2 s reporting the exit to a controller that is stopping anyway,
    end with them.  Checked by PID and start time; this host only.
    """
    for pid, started in owned.items():
        if pid in keep or not same_process(pid, started):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def descendants() -> dict[int, float]:
    """``{pid: start time}`` of every process below this one, however deep."""
    out: dict[int, float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            out[p.pid] = p.create_time()
        except psutil.Error as e:  # gone since the listing: nothing to own
            log.debug("pid %s: %s", p.pid, e)
    return out


class Spawned:
    """Every process one start spawned, by PID and start time.

    A start spawns through several hands -- ipyparallel's controller (which forks
    its schedulers), the launcher's engines or the zygote's forks, ssh clients,
    mpiexec, sbatch -- and a failure can come at any point, including in
    ipyparallel's own stop of a half-started controller.  So the start, not each
    hand, owns them: what this process has below it at the failure, less what it
    had before the start began (the warm zygote, other clusters), is this start's,
    and only that is stopped -- by PID and start time, never by name."""

    def __init__(self):
        self.before = descendants()

    def since(self) -> dict[int, float]:
        """What was spawned below this process since the start began."""
        return {pid: t for pid, t in descendants().items() if self.before.get(pid) != t}


def spawn_reaper(pids_file: str) -> subprocess.Popen:
    """The watcher (:mod:`dpnb._reaper`) that stops the PIDs ``pids_file`` lists if this
    process dies without stopping them (SIGKILL, SIGTERM, an OOM kill); in its own
    session, so signals aimed at this process do not reach it."""
    return subprocess.Popen(
        [sys.executable, "-m", "dpnb._reaper", str(os.getpid()), pids_file],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def write_pids(path: str, pids: dict[int, float]) -> None:
    """``pid start_time`` lines, replaced atomically (the reaper reads the file any time)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{pid} {t:.3f}\n" for pid, t in sorted(pids.items())))
    os.replace(tmp, path)


class StartWatch:
    """The reaper from a start's first process on, not from its end.

    A kernel killed while its cluster starts (SIGTERM 2 or 4 s into
    ``dpnb.start(2)``: measured, the controller and its 8 schedulers were left
    running) runs no cleanup, and the cluster's own reaper did not exist yet.
    So the start spawns the reaper at once and a thread writes what the start
    has spawned so far (:class:`Spawned`, the reaper itself left out) into its
    PID file every :attr:`PERIOD_S`; the cluster adopts it once formed
    (:meth:`Processes.adopt_reaper`), a failed start closes it."""

    PERIOD_S = 0.2

    def __init__(self, profile_dir: str, spawned: Spawned):
        self.path = os.path.join(profile_dir, PIDS_FILE)
        self.spawned = spawned
        write_pids(self.path, {})
        self.reaper = spawn_reaper(self.path)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpnb-start-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(self.PERIOD_S):
            self.write()

    def write(self) -> None:
        pids = {p: t for p, t in self.spawned.since().items() if p != self.reaper.pid}
        try:
            write_pids(self.path, pids)
        except OSError as e:  # the profile was removed: the start is being torn down
            log.debug("start's PID file not written: %s", e)

    def stop_writing(self) -> None:
        self._done.set()
        self._thread.join(2.0)

    def close(self) -> None:
        """A failed start, torn down: the reaper is not needed any more."""
        self.stop_writing()
        stop_reaper(self.reaper)


def stop_reaper(reaper: subprocess.Popen | None) -> None:
    if reaper is None:
        return
    try:
        reaper.terminate()
        reaper.wait(5)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("reaper %s did not stop: %s", reaper.pid, e)


#: the reaper's list of this host's PIDs of a cluster, in its profile folder
PIDS_FILE = "dpnb-pids.txt"


class Processes:
    """The OS-level side of one cluster: its local PIDs and the reaper.  Which
    processes are its, and how one engine is signalled, its launcher says."""

    def __init__(self, launcher: EngineLauncher, profile_dir: str):
        self.launcher = launcher
        self.profile_dir = profile_dir
        self.reaper: subprocess.Popen | None = None
        self.reaper_file = os.path.join(profile_dir, PIDS_FILE)

    # ---------------------------------------------------------------- engines
    # ---------------------------------------------------------------- owned
    def owned(self, ranks: Iterable[RankInfo]) -> dict[int, float]:
        """``{pid: start_time}`` of the processes this cluster runs on this host.

        The launcher says which (:meth:`~.launchers.EngineLauncher.root_pids`):
        the controller always; engine launchers (and mpiexec) only when they
        run here; for ssh clusters the ssh client processes, never the engine
        PIDs their agents report (those are PIDs on the remote hosts).
        """
        roots = self.launcher.root_pids(ranks)
        out: dict[int, float] = {}
        for pid in roots:
            try:
                p = psutil.Process(pid)
                out[pid] = p.create_time()
                for c in p.children(recursive=True):
                    out[c.pid] = c.create_time()
            except psutil.Error as e:
                log.debug("pid %s not listed as owned: %s", pid, e)
        return out

    # ---------------------------------------------------------------- reaper
    def adopt_reaper(self, watch: StartWatch, ranks: Iterable[RankInfo]) -> None:
        """The start's reaper (:class:`StartWatch`) becomes this cluster's: the PID
        file now lists what the cluster owns, rewritten on every change of ranks."""
        watch.stop_writing()
        self.write_reaper_file(ranks)
        self.reaper = watch.reaper

    def write_reaper_file(self, ranks: Iterable[RankInfo]) -> None:
        """Rewrite the reaper's ``pid start_time`` list (atomically).

        If it cannot be written the safety net is off: say so loudly rather
        than carry on as if a killed kernel would still clean up.
        """
        try:
            write_pids(self.reaper_file, self.owned(ranks))
        except OSError as e:
            log.error("reaper PID file %s not written: %s", self.reaper_file, e)
            warnings.warn(f"dpnb could not write {self.reaper_file} ({e}): if this kernel is "
                          "killed, its engines will not be stopped for it; %dp stop them "
                          "yourself", RuntimeWarning, stacklevel=3)

    def stop_reaper(self) -> None:
        stop_reaper(self.reaper)
