"""Every private torch / ipyparallel internal dpnb touches still exists in the installed versions.

dpnb.compat is the one place they are used; if a torch upgrade renames one,
this fails naming it, instead of a re-form or the gradsync view failing later
on a user's cluster.  torch runs in a subprocess with a world-size-1 gloo
group (a few seconds), so no process group lives in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpnb import compat

SCRIPT = """
import json, torch.distributed as dist
from torch.distributed import HashStore
dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
from dpnb import compat
print(json.dumps(compat.check_torch()))
dist.destroy_process_group()
"""


def test_torch_internals_dpnb_uses_exist():
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    problems = json.loads(p.stdout.strip().splitlines()[-1])
    assert problems == [], "dpnb.compat needs updating for this torch:\n" + "\n".join(problems)


def test_ipyparallel_internals_dpnb_uses_exist():
    assert compat.check_ipyparallel() == []


def test_result_metadata_reads_raw_and_public_metadata():
    class Raw:
        _metadata = [{"stdout": "hi"}]

    class Public:
        metadata = {"stdout": "there"}

    assert compat.result_metadata(Raw())["stdout"] == "hi"
    assert compat.result_metadata(Public())["stdout"] == "there"


def test_missing_internal_is_a_clear_error():
    class Zero:  # a ZeroRedundancyOptimizer without the fields dpnb re-binds
        pass

    with pytest.raises(compat.CompatError, match="ZeroRedundancyOptimizer.*missing in torch"):
        compat.point_zero_at_group(Zero(), None)


def test_torch_213_collective_names_exist_on_every_supported_torch(monkeypatch):
    import torch.distributed as dist

    from dpnb.compat import ensure_single_collectives

    assert ensure_single_collectives() == []  # this torch has them already
    # an older torch (< 2.13): only the old names
    monkeypatch.delattr(dist, "reduce_scatter_single")
    monkeypatch.delattr(dist, "all_gather_single")
    assert ensure_single_collectives() == ["reduce_scatter_single", "all_gather_single"]
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
    assert dist.all_gather_single is dist.all_gather_into_tensor
