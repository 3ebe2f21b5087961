"""An engine the kernel's OOM killer ends is named as an OOM kill, not a generic death.

As on a hosted notebook server: the notebook process and everything it starts
live in one memory cgroup with a limit.  A Python process holding a 2-rank
cluster is started inside a fresh child cgroup (limit 1.5 GiB, no swap); rank 1
then allocates 3 GiB, the kernel's OOM killer ends its engine (the largest
process), and the cell's report must say so -- with the cgroup's counter --
instead of "killed by SIGKILL".  Needs root and a writable memory cgroup (v1
or v2); skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

LIMIT = 1536 * 2 ** 20

HOLDER = """
import dpnb
from dpnb.errors import RemoteCellError
c = dpnb.start(2, timeout=60)
try:
    c.run("import torch\\nif rank == 1:\\n    big = torch.ones(3 * 2 ** 30 // 4)\\n", display=False)
    print("NO ERROR")
except RemoteCellError as e:
    print("SUMMARY", e)
    print(e.report)
print("DEAD", c.dead)
c.stop()
"""


def _memory_cgroup() -> tuple[str, str] | None:
    """(the folder to make a child cgroup in, "v1" or "v2") for this process, or None."""
    if os.geteuid() != 0:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, ctl, path = line.split(":", 2)
            if ctl == "" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
                return f"/sys/fs/cgroup{path}".rstrip("/"), "v2"
            if "memory" in ctl.split(","):
                base = f"/sys/fs/cgroup/memory{path}".rstrip("/")
                if os.path.exists(base):
                    return base, "v1"
    return None


def test_an_engine_the_oom_killer_ends_is_named_as_an_oom_kill(tmp_path):
    found = _memory_cgroup()
    if found is None:
        pytest.skip("needs root and a writable memory cgroup (v1 or v2)")
    base, version = found
    cg = os.path.join(base, f"dpnb-oom-test-{os.getpid()}")
    os.mkdir(cg)
    proc = None
    try:
        if version == "v2":
            with open(os.path.join(cg, "memory.max"), "w") as f:
                f.write(str(LIMIT))
            with open(os.path.join(cg, "memory.swap.max"), "w") as f:
                f.write("0")
        else:
            with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
                f.write(str(LIMIT))
        procs = os.path.join(cg, "cgroup.procs")

        def into_cgroup():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=into_cgroup)
        out, _ = proc.communicate(timeout=240)
        assert "NO ERROR" not in out, out
        assert "killed by the kernel's OOM killer" in out, out
        assert "oom_kill 0 -> 1" in out, out  # the fresh cgroup's own count
        assert "DEAD {1:" in out, out
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the cluster's processes leave with their holder
            try:
                os.rmdir(cg)
                break
            except OSError:  # what is left in the cgroup this test made is this test's
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        try:
                            psutil.Process(int(pid)).kill()
                        except psutil.Error:
                            pass  # gone meanwhile
                time.sleep(0.5)
        assert not os.path.exists(cg), f"{cg} still holds processes"
