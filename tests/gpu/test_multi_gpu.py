"""The NCCL path across two GPUs: what a world size of 1 cannot show.

A raise on one rank while the other waits inside an NCCL all-reduce (the side
door's abort, the re-formed communicator), the replicas after a release
during training, save and load across the release, every rank's buckets, and
user code that picks its GPU by ``LOCAL_RANK``.  Skipped, saying why, on a
machine with fewer than two CUDA GPUs; written before one was lent, so its
first run is also the first run of these paths.
"""

from __future__ import annotations

import pytest
import torch

import dpnb
from helpers.gpuruns import SETUP, assert_resumes_exactly, bucket_records_after_training

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"multi-GPU tier: needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")

RAISE = ("if rank == 1:\n    raise ValueError('boom')\n"
         "t = torch.ones(1, device=device)\ndist.all_reduce(t)")


@pytest.fixture(scope="module")
def two_gpus():
    c = dpnb.start(2, backend="nccl", timeout=20)
    yield c
    c.stop()


def test_cross_rank_raise_releases_and_reforms(two_gpus):
    c = two_gpus
    assert [r.device for r in c.ranks] == ["cuda:0", "cuda:1"]
    gen = c.generation
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c.run(RAISE, display=False)
    assert "raised ValueError: boom" in ei.value.report and "rank 0" in ei.value.report
    assert c.generation > gen  # rank 0 was inside the all-reduce: released, re-formed
    res = c.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)\nv = t.item()",
                display=False)
    assert res.ok and c.pull("v") == [2.0, 2.0]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_release_during_training_leaves_equal_replicas(two_gpus, strategy, tmp_path):
    c = two_gpus
    c.run(SETUP, display=False, setup=True)
    c.wrap("net", strategy)
    c.set_data("ds")
    c.train(steps=3, micro_batch=16, progress=False)
    with pytest.raises(dpnb.RemoteCellError):
        c.run(RAISE, display=False)
    assert c.check()["ok"]  # every rank holds the same model after the release
    assert_resumes_exactly(c, str(tmp_path / "ck"))


def test_every_rank_records_its_buckets(two_gpus):
    assert len(bucket_records_after_training(two_gpus)) == 2


def test_user_code_picking_its_gpu_by_local_rank_gets_the_ranks_gpu():
    """Issue 29, defect 7: --gpus 1,0 -- rank 0 must drive physical GPU 1, and
    set_device(LOCAL_RANK) in user code (as Accelerate does) must pick it."""
    c = dpnb.start(2, backend="nccl", gpus="1,0", timeout=20)
    try:
        c.run("import os\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
              "same = torch.cuda.current_device() == device.index\n"
              "mine = 'GPU-' + str(torch.cuda.get_device_properties(device).uuid)\n"
              "every = torch.cuda._raw_device_uuid_nvml()\n"
              "shown = os.environ['CUDA_VISIBLE_DEVICES']", display=False)
        assert c.pull("same") == [True, True]
        assert c.pull("shown") == ["1,0", "1,0"]
        every = c.pull("every")[0]
        assert c.pull("mine") == [every[1], every[0]]
    finally:
        c.stop()
