"""The CUDA / NCCL path end to end on one GPU (world size 1), as CI never runs it.

Start with NCCL, cells on CUDA tensors, every strategy wrapped and trained,
the steps moving the weights, checkpoints, CUDA memory measured beside the exact
prediction, gradsync timed with device events, mixed precision, FSDP CPU
offload, a raising rank and the re-formed NCCL group.
"""

from __future__ import annotations

import math

import pytest
import torch

import dpnb
from helpers.gpuruns import SETUP, assert_resumes_exactly, bucket_records_after_training


def test_nccl_start_and_cuda_cell(gpu_cluster):
    c = gpu_cluster
    assert c.backend == "nccl" and c.ranks[0].device == "cuda:0"
    # at world size 1 a sum proves nothing: the CUDA tensor's collective must go
    # through NCCL's backend of the default group
    res = c.run("t = torch.ones(4, device=device)\ndist.all_reduce(t)\n"
                "out = (str(t.device), t.sum().item(), "
                "type(dist.group.WORLD._get_backend(t.device)).__name__)", display=False)
    assert res.ok
    assert c.pull("out", rank=0) == ("cuda:0", 4.0, "ProcessGroupNCCL")
    row = c.status()[0]
    assert row["cuda_allocated"] is not None and row["cuda_allocated"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_wrap_train_check_save_load(gpu_cluster, strategy, tmp_path):
    c = gpu_cluster
    c.run(SETUP, display=False, setup=True)
    info = c.wrap("net", strategy)
    assert info["device"] == "cuda:0"
    c.set_data("ds")
    before = c.pull_model()
    s = c.train(steps=5, micro_batch=16, progress=False)
    assert s["steps"] == 5 and s["loss"] == s["loss"]  # finite
    # (at world size 1 a replica check compares a rank with itself: the steps must
    # have moved the weights instead)
    after = c.pull_model()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert_resumes_exactly(c, str(tmp_path / "ck"))


def test_memory_measured_beside_exact_prediction(gpu_cluster):
    from dpnb.core import ParamSpec, exact_rank_bytes

    c = gpu_cluster
    c.run(SETUP, display=False)
    c.wrap("net", "zero3")
    c.set_data("ds")
    c.train(steps=2, micro_batch=16, progress=False)
    snap = c.call("dpnb.engine.metrics.views.memory_snapshot").values[0]
    m = snap["measured"]
    assert m["allocated"] is not None and m["peak_allocated"] >= m["allocated"]
    specs = [ParamSpec(n, tuple(s), d, t) for n, s, d, t in snap["specs"]]
    pred = exact_rank_bytes(specs, 1, "zero3", snap["optimizer"])[0]
    assert m["total"] == pred.tensor_bytes, (m, pred)  # counted tensors == the exact model
    assert m["allocated"] >= m["total"]  # the allocator holds at least the model states


def test_gradsync_timed_with_device_events(gpu_cluster):
    (last,) = bucket_records_after_training(gpu_cluster)
    assert last["clock"] == "cuda_event"


@pytest.mark.parametrize("mp,strategy", [("bf16", "ddp"), ("bf16", "zero3"), ("fp16", "ddp"),
                                         ("fp16", "zero2")])
def test_mixed_precision(gpu_cluster, mp, strategy):
    c = gpu_cluster
    c.run(SETUP, display=False)
    # in effect, not only accepted: the first Linear's output during training
    # is in the half dtype (autocast for ddp, FSDP2's param_dtype for zero2/3)
    c.run("_dtypes = set()\n"
          "net[0].register_forward_hook(lambda m, i, o: _dtypes.add(str(o.dtype)))",
          display=False)
    c.wrap("net", strategy, mixed_precision=mp)
    c.set_data("ds")
    before = c.pull_model()
    s = c.train(steps=4, micro_batch=16, progress=False)
    assert len(s["losses"]) == 4 and all(math.isfinite(x) for x in s["losses"]), s["losses"]
    half = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[mp]
    assert c.pull("_dtypes", rank=0) == {half}
    after = c.pull_model()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the steps applied


def test_fsdp_cpu_offload(gpu_cluster):
    c = gpu_cluster
    c.run(SETUP, display=False)
    info = c.wrap("net", "zero3", cpu_offload=True)
    assert not info["notes"]  # honoured on a GPU (ignored, with a note, on CPU)
    c.set_data("ds")
    c.train(steps=2, micro_batch=16, progress=False)
    c.run("devs = sorted({str(p.to_local().device) for p in net.parameters()})", display=False)
    assert c.pull("devs", rank=0) == ["cpu"]


def test_raising_rank_then_a_reform_of_the_nccl_group(gpu_cluster):
    c = gpu_cluster
    gen = c.generation
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c.run("t = torch.ones(1, device=device)\nraise ValueError('boom')", display=False)
    assert "raised ValueError: boom" in ei.value.report
    assert c.generation == gen  # one rank, nobody waited: nothing to re-form
    c.run("_old_group = id(dist.group.WORLD)", display=False)  # an int: the re-form leaves it
    c.reform()  # a new NCCL communicator, and the group works on it
    assert c.generation == gen + 1
    # at world size 1 an all_reduce's sum proves nothing: check that the group is a
    # new NCCL one and that the collective ran on the GPU through it
    # (an NCCL cluster's group is "cpu:gloo,cuda:nccl", netplan.NCCL_GROUP: the CUDA
    # tensor's collective must go through the NCCL side of the new group)
    res = c.run("t = torch.full((3,), 2.0, device=device)\ndist.all_reduce(t)\n"
                "v = (id(dist.group.WORLD) != _old_group, "
                "type(dist.group.WORLD._get_backend(t.device)).__name__, t.device.type,"
                " t.tolist())", display=False)
    assert res.ok and c.pull("v") == [(True, "ProcessGroupNCCL", "cuda", [2.0, 2.0, 2.0])]


def test_nccl_refuses_two_ranks_on_one_gpu():
    import torch

    n = torch.cuda.device_count()
    with pytest.raises(dpnb.DpnbError, match=f"needs {n + 1} GPUs"):
        dpnb.start(n + 1, backend="nccl")
    with pytest.raises(dpnb.DpnbError, match="NCCL refuses two ranks on one device"):
        dpnb.start(2, backend="nccl", gpus="0,0")
