"""The tests' bounded job runner (``helpers.bounded``): an overrun fails fast
with every process's stacks, and leaves none of the group behind."""

import os
import sys
import time

import pytest
from helpers.bounded import run_bounded

# a shell whose two Python children sleep: one in the background that ignores
# SIGABRT and writes elsewhere (it outlives the shell, and the output ends
# without it), one in the foreground
HANG = (f"{sys.executable} -c 'import signal, time\nsignal.signal(signal.SIGABRT, signal.SIG_IGN)\n"
        f"while True: time.sleep(0.5)' >/dev/null 2>&1 & echo $! > {{pidfile}}; "
        f"{sys.executable} -c 'import time\ndef hold():\n    time.sleep(100)\nhold()'")


def test_an_overrun_fails_with_each_processs_stacks_and_leaves_none(tmp_path):
    pidfile = tmp_path / "bg.pid"
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as e:
        run_bounded(["bash", "-c", HANG.format(pidfile=pidfile)], timeout_s=2)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "did not end within 2 s" in msg
    assert "in hold" in msg and msg.count("Fatal Python error: Aborted") == 1, msg
    bg = int(pidfile.read_text())
    for _ in range(50):  # bounded: the kill is sent; the zombie is reaped by init
        if not os.path.exists(f"/proc/{bg}") or open(f"/proc/{bg}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the background child {bg} still runs")


def test_a_job_in_time_returns_its_output():
    p = run_bounded([sys.executable, "-c", "print('done')"], timeout_s=30)
    assert p.returncode == 0 and p.stdout == "done\n"
