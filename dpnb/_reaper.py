"""Stops a dpnb cluster's processes when the kernel that owns it is gone.

Started by :class:`dpnb.cluster.Cluster` for local clusters, in its own
session so that signals aimed at the kernel do not reach it.  A kernel that
exits normally stops its cluster itself (atexit); this covers a kernel that is
SIGKILLed (a "restart" after a hung shutdown, an OOM kill), which runs no
cleanup.  It only ever kills the PIDs the kernel wrote to ``pids_file``, and
only while their start time still matches, so a recycled PID is never hit.

A cluster started with ``--keep TTL`` outlives its kernel: then ``keep.json``
beside the PID file names the kernel holding it now (``%dp attach`` moves it
to a new one) and the time-to-live.  While no kernel holds it the reaper
counts down -- writing when the countdown began into ``keep.json``, so that
``%dp list`` can show it -- and stops everything when the TTL has passed,
removing the registry record named there too.

Usage: ``python -m dpnb._reaper KERNEL_PID PIDS_FILE``
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import psutil

KEEP_FILE = "keep.json"


def _read(path: str) -> list[tuple[int, float]]:
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]
        return [(int(p), float(t)) for p, t in rows]
    except (OSError, ValueError):
        return []


def _keep(path: str) -> dict | None:
    try:
        with open(os.path.join(os.path.dirname(path), KEEP_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_keep(profile: str, keep: dict) -> None:
    """Replace ``keep.json`` in ``profile`` atomically (the kernel and the reaper both write)."""
    tmp = os.path.join(profile, KEEP_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(keep, f)
    os.replace(tmp, os.path.join(profile, KEEP_FILE))


def _alive(pid, started) -> bool:
    try:
        return started is not None and abs(psutil.Process(int(pid)).create_time() - started) < 0.01
    except (psutil.Error, ValueError, TypeError):
        return False


def main(argv: list[str]) -> int:
    kernel_pid, path = int(argv[0]), argv[1]
    try:
        kernel_start = psutil.Process(kernel_pid).create_time()
    except psutil.Error:
        kernel_start = None
    last: list[tuple[int, float]] = []
    keep = None
    profile_dir = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.exists(path):
            last = _read(path) or last
            keep = _keep(path) or keep
        elif last:  # the profile dir was removed: the cluster was stopped cleanly
            return 0
        if keep is None:
            if not _alive(kernel_pid, kernel_start):
                break
        elif _alive(keep.get("owner_pid"), keep.get("owner_start")):
            keep.pop("detached_at", None)
        else:  # kept, and no kernel holds it: count down
            if keep.get("detached_at") is None:
                keep["detached_at"] = time.time()
                try:
                    write_keep(os.path.dirname(path), keep)
                except OSError:
                    pass  # the countdown runs here anyway; %dp list shows less
            if time.time() >= keep["detached_at"] + float(keep.get("ttl_s", 0)):
                break
        time.sleep(0.5)
    procs: dict[int, psutil.Process] = {}
    for pid, started in last:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 0.01:
                procs[pid] = p
                # what it started since the list was written (the controller's
                # schedulers, a zygote's forks) is the cluster's too
                procs.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:  # gone already (or never ours): nothing to stop
            pass
    procs.pop(os.getpid(), None)
    procs = list(procs.values())
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:  # it ended between the check and the signal
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:  # it ended after all
            pass
    # The profile holds the cluster's keys; the kernel could not remove it.
    if os.path.basename(profile_dir).startswith("dpnb-profile-"):
        shutil.rmtree(profile_dir, ignore_errors=True)
    record = (keep or {}).get("record")
    if record and os.path.basename(record).endswith(".json"):
        try:
            os.remove(record)
        except OSError:
            pass  # already gone: %dp list drops records whose profile is gone too
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
