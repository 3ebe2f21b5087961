"""The notebook's own process killed -- SIGTERM from a terminal or a container
stop, SIGKILL from the OOM killer -- leaves no process of its cluster behind,
during the start as after it.

Measured before the fix: SIGTERM 2 or 4 s into ``dpnb.start(2)`` left the
ipyparallel controller and its 8 schedulers running for good (the reaper was
started only once the group had formed).  The process under test is a plain
Python holding a 2-rank cluster, as a kernel would; every process below it is
recorded while it runs, by PID and start time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from helpers import nbutil as nbu

HOLDER = "import dpnb, time\nc = dpnb.start(2)\nprint('READY', flush=True)\ntime.sleep(600)\n"


def _kill_holder(sig: int, after_ready: bool, delay_s: float) -> tuple[dict, dict]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    seen: dict[int, float] = {}
    try:
        if after_ready:
            assert p.stdout.readline().strip() == "READY"
        t0 = time.monotonic()
        while time.monotonic() - t0 < delay_s and p.poll() is None:
            seen.update(nbu.descendants(p.pid))
            time.sleep(0.05)
        seen.update(nbu.descendants(p.pid))
        p.send_signal(sig)
        p.wait(10)
        left = nbu.alive(seen, wait_s=15)
    finally:
        nbu.kill(seen)  # never leave them to the next test
        if p.poll() is None:
            p.kill()
    return seen, left


@pytest.mark.parametrize("sig,after_ready,delay_s", [
    (signal.SIGTERM, False, 2.5),  # mid-start: controller up, engines starting
    (signal.SIGTERM, True, 0.5),  # the done-when's case: a cluster held, not kept
    (signal.SIGKILL, False, 4.0),
], ids=["SIGTERM during start", "SIGTERM after start", "SIGKILL during start"])
def test_a_killed_notebook_process_leaves_no_process_of_its_cluster(sig, after_ready, delay_s):
    seen, left = _kill_holder(sig, after_ready, delay_s)
    assert len(seen) >= 2, f"nothing was started to leave behind: {seen}"
    assert left == {}, f"left running 15 s after the kill: {left}"
