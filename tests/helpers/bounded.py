"""A job run by a test (``bash run.sh``: torchrun and its workers), bounded, and
made to say where it stood when it overran.

``subprocess.run(..., timeout=)`` kills only the direct child on timeout and
returns nothing it printed; a torchrun job that hangs then leaves its agent
and workers behind and the failure says only "Timeout".  Here the job runs in
its own session with Python's faulthandler on: on overrun the whole group gets
SIGABRT (every Python process in it prints each thread's stack to stderr),
then SIGKILL, and the test fails with those stacks.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_bounded(cmd: list[str], *, timeout_s: float, env: dict | None = None,
                grace_s: float = 10.0, **kw) -> subprocess.CompletedProcess:
    """``cmd``'s result; on overrun a test failure carrying each process's stacks
    (``grace_s``: how long they have to print them before SIGKILL)."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(p.pid, signal.SIGABRT)  # faulthandler: each process prints its stacks
    try:
        out, err = p.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:  # one of them survived SIGABRT and holds the pipes
        _signal_group(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=10)
    _signal_group(p.pid, signal.SIGKILL)  # what outlived the shell (torchrun's workers)
    pytest.fail(f"{' '.join(cmd)} did not end within {timeout_s:.0f} s; its stacks at "
                f"SIGABRT follow\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-12000:]}",
                pytrace=False)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # every process of the group has ended
        pass
