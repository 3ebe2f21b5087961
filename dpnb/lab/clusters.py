"""What ``/api/dpnb/clusters`` answers, and the actions on one cluster (no tornado here).

Two sources, both private files of this user, both written by the clusters'
holders: each running kernel's publication (:func:`dpnb.cluster.publish.published`:
ranks, progress, last error, the last profile's summary, dropped once its kernel
is gone) and the kept clusters' records (:func:`dpnb.cluster.keep.kept`: who holds them, when the
reaper stops them).  A kept cluster held by a running kernel is in both; it
is listed once, with both parts.  Secrets of the records (the side doors'
token, ports) never leave this module: each cluster becomes a small JSON
object of what the sidebar shows.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from ..cluster import keep as keeping
from ..cluster.processes import same_process, start_time
from ..cluster.publish import published
from ..core.errors import UserError

log = logging.getLogger(__name__)

ACTIONS = ("stop", "interrupt", "restart", "restart-resume", "attach-code")
#: the magic each action is, for a cluster that only its notebook may drive
MAGIC = {"restart-resume": "restart --resume"}
#: seconds a stop or restart of a kept cluster may take (its own process)
ACT_TIMEOUT_S = 120


class ActionError(UserError):
    """An action the cluster cannot take now (the message says what to do instead)."""


def _rss_mb(pid: int) -> float | None:
    """A live local engine's resident memory, read by the server (same user, same host)."""
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error as e:  # gone between the liveness check and now
        log.info("memory of pid %s: %s", pid, e)
        return None


class GpuMemory:
    """Each process's GPU memory on this host, by PID (MiB); empty where there is no GPU.

    Never read on the caller's thread: the server's loop answers every
    request of the user's notebooks, and a GPU query may hang (``nvidia-smi``
    was given 5 s).  A call returns the last reading at once and, when that
    is older than :data:`GPU_CACHE_S`, starts one refresh on a thread of its
    own (never two at a time).  NVML (``pynvml``, where installed) is asked
    first -- no process to start -- else ``nvidia-smi``.  So the first call
    answers empty and the sidebar shows GPU memory from its next poll on.
    The server's handler owns one (its reading lives as long as the server)."""

    GPU_CACHE_S = 2.0
    SMI_TIMEOUT_S = 5.0

    def __init__(self):
        self.at, self.by_pid = -1e9, {}
        self.lock = threading.Lock()
        self.refreshing = False

    def __call__(self) -> dict[int, float]:
        with self.lock:
            if time.monotonic() - self.at >= self.GPU_CACHE_S and not self.refreshing:
                self.refreshing = True
                threading.Thread(target=self._refresh, name="dpnb-gpu-memory", daemon=True).start()
            return self.by_pid

    def _refresh(self) -> None:
        try:
            got = _nvml_by_pid()
            if got is None:
                got = _smi_by_pid(self.SMI_TIMEOUT_S)
        except Exception as e:  # a failed reading leaves the last one; the next poll retries
            log.info("GPU memory per process not read: %s: %s", type(e).__name__, e)
            got = None
        with self.lock:
            if got is not None:
                self.by_pid = got
            self.at, self.refreshing = time.monotonic(), False


def _nvml_by_pid() -> dict[int, float] | None:
    """GPU memory by PID from NVML, or None where pynvml or the driver is missing."""
    try:
        import pynvml  # lazy: optional (NVIDIA's nvidia-ml-py), absent on CPU hosts
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.info("NVML not available (%s): nvidia-smi instead", e)
        return None
    try:
        out: dict[int, float] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.usedGpuMemory is not None:
                    out[int(p.pid)] = out.get(int(p.pid), 0.0) + p.usedGpuMemory / 2**20
        return out
    finally:
        pynvml.nvmlShutdown()


def _smi_by_pid(timeout: float) -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.info("no GPU memory per process here (nvidia-smi: %s)", e)
        return out
    for line in text.splitlines():
        pid, _, mib = line.partition(",")
        try:
            out[int(pid)] = out.get(int(pid), 0.0) + float(mib)
        except ValueError:
            log.info("nvidia-smi line %r not understood: skipped", line)
    return out


def _rank(r: dict, local: bool, gpu: GpuMemory) -> dict:
    out = {k: r.get(k) for k in ("rank", "host", "pid", "device", "alive")}
    live = local and r.get("alive")
    out["rss_mb"] = _rss_mb(int(r["pid"])) if live else None
    # a live local CUDA rank's GPU memory, read by PID as its resident memory is
    cuda = live and str(r.get("device") or "").startswith("cuda")
    out["gpu_mb"] = gpu().get(int(r["pid"])) if cuda else None
    return out


def _from_kernel(rec: dict, gpu: GpuMemory) -> dict:
    return {"id": rec["id"], "source": "kernel", "kernel_pid": rec["kernel"]["pid"],
            "kernel_id": rec["kernel"].get("kernel_id"), "kept": bool(rec.get("kept")),
            "holder": rec["kernel"]["pid"], "stops_in_s": None, "backend": rec.get("backend"),
            "launcher": rec.get("launcher"), "created": rec.get("created"),
            "ranks": [_rank(r, bool(rec.get("local")), gpu) for r in rec.get("ranks", [])],
            "progress": rec.get("progress") or {}, "curve": rec.get("curve") or [],
            "last_error": rec.get("last_error"),
            "last_profile": rec.get("last_profile"),
            # the last train call's step: gradient sync and memory per rank (core/labviews)
            "gradsync": rec.get("gradsync"), "memory": rec.get("memory"),
            # what agents may do and did (dpnb.agent.service); the door's path stays here
            "agent": rec.get("agent")}


def _kept_progress(rec: dict) -> dict:
    s = (rec.get("last_train") or {}).get("summary") or {}
    return {"step": s.get("last_step"), "loss": s.get("loss"),
            "samples_per_s": s.get("samples_per_s")} if s else {}


def _from_keep(rec: dict, gpu: GpuMemory) -> dict:
    # kept clusters' engines are this host's processes (--keep takes local engines only)
    ranks = [_rank({**r, "alive": start_time(int(r["pid"])) is not None}, True, gpu)
             for r in rec.get("ranks", [])]
    return {"id": rec["id"], "source": "kept", "kernel_pid": rec.get("holder"),
            "kernel_id": None, "kept": True, "holder": rec.get("holder"),
            "stops_in_s": rec.get("stops_in_s"), "backend": rec.get("backend"),
            "launcher": "local", "created": rec.get("created"), "ranks": ranks,
            "progress": _kept_progress(rec), "curve": [], "last_error": None,
            "last_profile": None, "gradsync": None, "memory": None, "agent": None}


def clusters(gpu: GpuMemory | None = None) -> list[dict]:
    """Every dpnb cluster of this user here: the running kernels' and the kept ones.
    ``gpu``: the caller's reading of GPU memory (the handler's, reused); a fresh one
    when None."""
    gpu = gpu or GpuMemory()
    out = {}
    for rec in published():
        out[rec["id"]] = _from_kernel(rec, gpu)
    for rec in keeping.kept():
        k = _from_keep(rec, gpu)
        if rec["id"] in out:  # held by a running kernel: its publication is fresher
            out[rec["id"]].update(kept=True, stops_in_s=k["stops_in_s"])
            continue
        out[rec["id"]] = k
    for c in out.values():
        c["world_size"] = len(c["ranks"])
        c["alive"] = sum(1 for r in c["ranks"] if r["alive"])
    return sorted(out.values(), key=lambda c: c.get("created") or 0)


def find(cluster_id: str) -> dict:
    for c in clusters():
        if c["id"] == cluster_id:
            return c
    raise KeyError(cluster_id)


def _interrupt(cluster_id: str) -> dict:
    """SIGINT to each live local engine, as ``%dp interrupt`` / Ctrl-C does; checked by
    PID and start time where the publication has it, so a reused PID is never hit."""
    starts = {r["pid"]: r.get("pid_start") for p in published() if p["id"] == cluster_id
              for r in p.get("ranks", [])}
    sent = []
    for r in find(cluster_id)["ranks"]:
        pid = int(r["pid"])
        if not r["alive"] or (starts.get(pid) and not same_process(pid, starts[pid])):
            continue
        try:
            os.kill(pid, signal.SIGINT)
            sent.append(r["rank"])
        except ProcessLookupError:
            log.info("rank %s (pid %s) ended before its interrupt", r["rank"], pid)
    return {"interrupted": sent}


def _in_own_process(verb: str, cluster_id: str) -> dict:
    """Stop or restart a kept cluster that no kernel holds: a short-lived process attaches
    (it holds the cluster meanwhile), acts, and stops it or lets go (:mod:`dpnb.lab.act`)."""
    proc = subprocess.run([sys.executable, "-m", "dpnb.lab.act", verb, cluster_id],
                          capture_output=True, text=True, timeout=ACT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
        raise ActionError(f"{verb} {cluster_id} failed: {lines[-1]}")
    return {"message": proc.stdout.strip()}


def act(cluster_id: str, action: str) -> dict:
    """Do ``action`` on cluster ``cluster_id``; raises KeyError (no such cluster) or ActionError."""
    if action not in ACTIONS:
        raise ActionError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    c = find(cluster_id)
    if action == "interrupt":
        return _interrupt(cluster_id)
    if action == "attach-code":
        if not c["kept"]:
            raise ActionError(f"cluster {cluster_id} ends with its kernel: only kept clusters "
                              f"(%dp start --keep 2h) can be attached from another notebook")
        return {"code": f"%dp attach {cluster_id}"}
    if c["holder"] is not None:
        raise ActionError(f"cluster {cluster_id} is held by kernel {c['holder']}: run "
                          f"%dp {MAGIC.get(action, action)} in its notebook (or shut that "
                          f"kernel down)")
    return _in_own_process(action, cluster_id)
