"""The host agent: one process per remote host, started over ssh, that owns that host's engines.

``ssh HOST PYTHON -m dpnb.engine.hostagent`` -- one ssh connection per host,
for the cluster's whole life.  The notebook (``dpnb.cluster.agents``) talks
to it in JSON lines on the connection's stdin/stdout:

* ``{"cmd": "hello", "connection": TEXT, "env": {...}}`` -- the controller's
  engine connection info (kept in a private temporary folder on this host,
  removed when the agent exits) and the environment for every engine;
  answered with the host's name, Python and library versions;
* ``{"cmd": "start", "n": K}`` -- start K engines (``python -m
  dpnb.engine.boot``); answered with their PIDs;
* ``{"cmd": "signal", "pid": P, "sig": S}`` -- signal one of *its own*
  engines (a PID it did not start is refused: PIDs here mean nothing on the
  notebook's host, and the agent only touches what it started);
* ``{"cmd": "stop"}`` -- stop every engine (SIGTERM, SIGKILL after a grace),
  answer, and exit.

Events flow back unasked too: ``{"event": "exit", "pid": P, "code": C,
"tail": ...}`` when an engine ends.  End of input means the notebook's
kernel (or its ssh) is gone: the agent stops its engines and exits, so a
killed kernel leaves nothing running on the remote hosts.  Engines watch the
agent in turn (``DPNB_WATCH_PARENT``) and exit if it is SIGKILLed.

Only the standard library is imported here: the agent must start in well
under a second, and it never touches torch -- except as a *zygote*
(``--zygote``, dpnb's local launcher): then it imports torch, ipyparallel's
engine and what the first ``%dp wrap`` needs once, and *forks* each engine
from itself, so N engines on one host import torch once instead of N times
(pages are shared copy-on-write).  Nothing touches CUDA before the fork;
each engine picks its GPU after, in ``init_rank``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import PackageNotFoundError, version

from dpnb.core.gpus import NVIDIA_CTL
from dpnb.engine import template
from dpnb.engine.agentrecords import Record, stat_fields

GRACE_S = 3.0  # SIGTERM -> SIGKILL


class _Forked:
    """The part of ``subprocess.Popen`` the agent uses, for an engine forked
    from this (zygote) agent: the watcher thread reaps it with ``waitpid``."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._done = threading.Event()

    def reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)  # -N: killed by signal N, as Popen
        self._done.set()
        return self.returncode

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def _zygote_imports() -> None:
    """What every engine would import by itself, imported once before forking."""
    from dpnb.engine.proc.preload import PRELOAD_MODULES, import_quietly  # torch-free itself

    def report(name: str, e: Exception) -> None:  # the agent's stderr reaches the notebook
        print(f"dpnb zygote: import of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)

    import_quietly(("torch", "torch.distributed", "ipyparallel.engine.app", "dpnb.engine.boot",
                    *PRELOAD_MODULES), report)


class Agent:
    def __init__(self, out=sys.stdout, zygote: bool = False):
        self.out = out
        self.zygote = zygote
        self.lock = threading.Lock()
        self.dir = tempfile.mkdtemp(prefix="dpnb-host-")
        self.conn_file = os.path.join(self.dir, "engine.json")
        self.env: dict[str, str] = {}
        self.base_env: dict[str, str] | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, str] = {}
        self.serial = 0
        self.record: Record | None = None  # this cluster's agent on this host (agentrecords)

    def send(self, msg: dict) -> None:
        with self.lock:
            self.out.write(json.dumps(msg) + "\n")
            self.out.flush()

    # ---------------------------------------------------------------- commands
    def hello(self, msg: dict) -> dict:
        with open(os.open(self.conn_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(msg["connection"])
        self.env = {str(k): str(v) for k, v in (msg.get("env") or {}).items()}
        # a local zygote may have been started long before its cluster: its
        # engines take the notebook's environment of now, as spawned ones would
        if msg.get("environ") is not None:
            self.base_env = {str(k): str(v) for k, v in msg["environ"].items()}
        versions = {}
        for mod in ("dpnb", "ipyparallel", "torch"):
            versions[mod] = _version(mod)
        superseded = []
        if msg.get("cluster"):  # an earlier agent of this cluster here lost its notebook
            self.record = Record(str(msg["cluster"]))
            superseded = self.record.supersede()
            self.record.write([])
        return {"host": socket.gethostname(), "python": sys.executable, "pid": os.getpid(),
                "versions": versions, "cpu_count": os.cpu_count() or 1, "zygote": self.zygote,
                "superseded": superseded}

    def start(self, msg: dict) -> dict:
        pids = []
        for _ in range(int(msg.get("n", 1))):
            self.serial += 1
            log = os.path.join(self.dir, f"engine-{self.serial}.log")
            base = os.environ if self.base_env is None else self.base_env
            env = {**base, **self.env, "DPNB_CONNECTION_FILE": self.conn_file,
                   "DPNB_CONNECTION_WAIT": "60", "DPNB_WATCH_PARENT": "1"}
            if self.zygote:
                self._check_fork_safe()
                p = self._fork(env, log)
            else:
                with open(log, "wb") as f:
                    p = subprocess.Popen([sys.executable, "-m", "dpnb.engine.boot"], env=env,
                                         stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=os.path.expanduser("~"))
            self.procs[p.pid] = p
            self.logs[p.pid] = log
            threading.Thread(target=self._watch, args=(p,), daemon=True).start()
            pids.append(p.pid)
        if self.record is not None:
            self.record.write([q.pid for q in self.procs.values() if q.poll() is None])
        return {"pids": pids}

    def _check_fork_safe(self) -> None:
        if "torch" not in sys.modules:
            return
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.device import driver_loaded

        # not torch.cuda.is_initialized(): is_available() without NVML already
        # ran cuInit, and a child forked after that cannot use the GPU either
        if sys.modules["torch"].cuda.is_initialized() or driver_loaded():
            raise RuntimeError("CUDA was initialised in the zygote before forking; its engines "
                               "could not use the GPU: start with --no-zygote")

    def _fork(self, env: dict, log: str) -> _Forked:
        """One engine, forked from this process (torch already imported).

        The child leaves the agent's session and pipes (stdin from /dev/null,
        output to its log, the protocol's descriptor closed), takes the
        engine environment and runs what ``python -m dpnb.engine.boot`` runs;
        it never returns into the agent's code.
        """
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        pid = os.fork()
        if pid:
            os.close(fd)
            return _Forked(pid)
        code = 1
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(self.out.fileno())
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(env)
            # the zygote (or the kernel's template, long before) may have asked for
            # the temporary folder already: the engine's comes from its own TMPDIR
            tempfile.tempdir = None
            sys.argv = [sys.argv[0]]
            # lazy: the forked engine imports boot once its own environment is in place
            from dpnb.engine import boot

            boot.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0
        except BaseException as e:  # the log is all the notebook will see: say why
            print(f"dpnb engine (forked) failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # the engine is ending; its log is what it is
                    pass
            os._exit(code)

    def signal(self, msg: dict) -> dict:
        pid, sig = int(msg["pid"]), int(msg["sig"])
        p = self.procs.get(pid)
        if p is None or p.poll() is not None:
            return {"sent": False, "why": f"pid {pid} is not a running engine of this agent"}
        p.send_signal(sig)
        return {"sent": True}

    def states(self, msg: dict) -> dict:
        """Which of the notebook's ``pids`` (engines of this agent) are frozen: stopped
        (SIGSTOP, a job-control stop) or held by a tracer, in psutil's words.  The
        notebook asks while a cell waits on a rank of this host (about once a
        second), to name a frozen rank and release its peers."""
        out = {}
        for pid in (int(p) for p in msg.get("pids", ())):
            p = self.procs.get(pid)
            if p is None or p.poll() is not None:
                continue
            how = _stop_state(pid)
            if how is not None:
                out[str(pid)] = how
        return {"states": out}

    def stop(self, _msg: dict | None = None) -> dict:
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _quiet_signal(p, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _quiet_signal(p, signal.SIGKILL)
                p.wait()
        return {"stopped": sorted(p.pid for p in live)}

    # ---------------------------------------------------------------- loop
    def _watch(self, p) -> None:
        code = p.reap() if isinstance(p, _Forked) else p.wait()
        self.send({"event": "exit", "pid": p.pid, "code": code, "tail": _tail(self.logs[p.pid])})

    def serve(self, inp=sys.stdin) -> None:
        try:
            for line in inp:
                if not line.strip():
                    continue
                msg = json.loads(line)
                cmd = msg.get("cmd")
                handler = {"hello": self.hello, "start": self.start, "signal": self.signal,
                           "stop": self.stop, "states": self.states,
                           "ping": lambda m: {"pong": True}}.get(cmd)
                try:
                    if handler is None:
                        raise ValueError(f"unknown command {cmd!r}")
                    reply = {"id": msg.get("id"), "ok": True, **handler(msg)}
                except Exception as e:  # reported to the notebook, which raises it there
                    reply = {"id": msg.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"}
                self.send(reply)
                if cmd == "stop":
                    return
        finally:
            self.stop()  # end of input: the notebook is gone
            if self.record is not None:
                self.record.remove()
            shutil.rmtree(self.dir, ignore_errors=True)


#: /proc/PID/stat's state letters of a process that runs no code until continued
STOP_STATES = {"T": "stopped", "t": "tracing-stop"}


def _stop_state(pid: int) -> str | None:
    fields = stat_fields(pid)  # None: gone meanwhile, its exit is reported by _watch
    return STOP_STATES.get(fields[0]) if fields else None


def _quiet_signal(p: subprocess.Popen, sig: int) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return ""


def _version(mod: str) -> str | None:
    try:
        return version(mod)
    except PackageNotFoundError:
        return None


def zygote_wanted(argv: list[str], nvidia_ctl: str = NVIDIA_CTL) -> bool:
    """``--zygote``: fork every engine from this agent; ``--zygote-auto`` (ssh hosts):
    the local launcher's default rule, read on this host -- fork only where no
    NVIDIA driver is (a CUDA context made before a fork is unusable in the
    children, and forking on GPU hosts is untested)."""
    return "--zygote" in argv or ("--zygote-auto" in argv
                                  and not os.path.exists(nvidia_ctl))


def main() -> None:
    if template.FLAG in sys.argv[1:]:  # the kernel's template: an agent forked per start
        _zygote_imports()
        template.serve(socket.socket(fileno=0), lambda inp: run_agent(inp, zygote=True))
        os._exit(0)
    zygote = zygote_wanted(sys.argv[1:])
    if zygote:
        _zygote_imports()
    run_agent(sys.stdin, zygote)


def run_agent(inp, zygote: bool) -> None:
    """Serve the kernel on ``inp`` and stdout until the end of input; never returns."""
    # stdout carries the protocol; anything else a library prints goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    Agent(out, zygote=zygote).serve(inp)
    out.flush()
    # a zygote holds torch: Python's teardown of it took 1-2 s, for nothing
    os._exit(0)


if __name__ == "__main__":
    main()
