"""Stops a dpnb cluster's processes when the kernel that owns it is gone.

Started by :class:`dpnb.cluster.Cluster` for local clusters, in its own
session so that signals aimed at the kernel do not reach it.  A kernel that
exits normally stops its cluster itself (atexit); this covers a kernel that is
SIGKILLed (a "restart" after a hung shutdown, an OOM kill), which runs no
cleanup.  It only ever kills the PIDs the kernel wrote to ``pids_file``, and
only while their start time still matches, so a recycled PID is never hit.

Usage: ``python -m dpnb._reaper KERNEL_PID PIDS_FILE``
"""

from __future__ import annotations

import os
import shutil
import sys
import time


def _read(path: str) -> list[tuple[int, float]]:
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]
        return [(int(p), float(t)) for p, t in rows]
    except (OSError, ValueError):
        return []


def main(argv: list[str]) -> int:
    import psutil

    kernel_pid, path = int(argv[0]), argv[1]
    try:
        kernel = psutil.Process(kernel_pid)
        kernel_start = kernel.create_time()
    except psutil.Error:
        kernel_start = None
    last: list[tuple[int, float]] = []
    while True:
        if os.path.exists(path):
            last = _read(path) or last
        elif last:  # the profile dir was removed: the cluster was stopped cleanly
            return 0
        try:
            alive = kernel_start is not None and psutil.Process(kernel_pid).create_time() == kernel_start
        except psutil.Error:
            alive = False
        if not alive:
            break
        time.sleep(0.5)
    procs = []
    for pid, started in last:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 0.01:
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    # The profile holds the cluster's keys; the kernel could not remove it.
    profile = os.path.dirname(os.path.abspath(path))
    if os.path.basename(profile).startswith("dpnb-profile-"):
        shutil.rmtree(profile, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
