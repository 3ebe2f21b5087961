"""torch's ``dist.breakpoint`` as dpnb replaces it on a rank: ``timeout_s``
and ``skip`` honoured as torch honours them (one process, world size 1)."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, types
import torch, torch.distributed as dist
from torch.distributed import HashStore
from dpnb.engine.debugging import rankpdb

dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
other = dist.new_group([0])
state = types.SimpleNamespace(rank=0, timeout_s=1800.0, cell_guard=None)
rankpdb.install(state)
dist.breakpoint(rank=1, timeout_s=7)  # rank 1 is debugged: rank 0 only waits in the barrier
cpu = torch.device("cpu")
seconds = lambda g: g._get_backend(cpu).options._timeout.total_seconds()
print(json.dumps([seconds(dist.group.WORLD), seconds(other)]))
"""


def test_dist_breakpoint_gives_every_group_its_timeout_as_torch_does():
    """The ranks that wait for the debugged one wait ``timeout_s`` (torch sets
    it on every group), not the cluster's group timeout."""
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [7.0, 7.0]
