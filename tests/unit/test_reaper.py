"""The reaper (``python -m dpnb._reaper KERNEL_PID PIDS_FILE``) stops what the PID
file lists once its kernel is gone -- and what those processes started after the
list was written (a controller's schedulers, a zygote's forks), found below them.
Run against stand-in processes: a "kernel" and a "controller" that forks a
"scheduler" only after the list is written."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import psutil

CONTROLLER = ("import subprocess, sys, time\n"
              "time.sleep(1.0)  # the list is written before this child exists\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              "time.sleep(120)\n")


def test_the_reaper_stops_the_listed_processes_and_their_later_children():
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # started through a parent that exits at once, as the kernel's own children are
    # once it is dead: init reaps them, so a stopped one does not linger as a zombie
    spawn = subprocess.run([sys.executable, "-c", "import subprocess, sys\n"
                            f"print(subprocess.Popen([sys.executable, '-c', {CONTROLLER!r}], "
                            f"stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                           capture_output=True, text=True, check=True)
    ctl = psutil.Process(int(spawn.stdout))
    folder = tempfile.mkdtemp(prefix="dpnb-profile-")
    path = os.path.join(folder, "dpnb-pids.txt")
    with open(path, "w") as f:
        f.write(f"{ctl.pid} {ctl.create_time():.3f}\n")
    reaper = subprocess.Popen([sys.executable, "-m", "dpnb._reaper", str(kernel.pid), path])
    try:
        deadline = time.monotonic() + 10
        while not ctl.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (scheduler,) = ctl.children()
        kernel.kill()  # the kernel dies without cleaning up
        kernel.wait()
        reaper.wait(20)
        gone, alive = psutil.wait_procs([ctl, scheduler], timeout=5)
        assert alive == [], f"left running: {[p.pid for p in alive]}"
        assert not os.path.exists(folder)  # the profile (the cluster's keys) went with them
    finally:
        for p in (kernel, reaper):
            if p.poll() is None:
                p.kill()
        if ctl.is_running():
            for c in [*ctl.children(recursive=True), ctl]:
                c.kill()
