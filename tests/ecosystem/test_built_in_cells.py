"""Objects people build in cells themselves -- DDP, ZeroRedundancyOptimizer, FSDP2,
Accelerate, a DistributedSampler, data parallelism by hand -- train in step, keep
working after a release, and a mistake with them costs no engine."""

from __future__ import annotations

import time

import pytest
from helpers.ecosystem import ACCELERATE_LOOP, IN_SYNC, QUICK_S, assert_whole, script
from helpers.releases import raise_before_all_reduce

from dpnb.errors import RemoteCellError


def test_ddp_zero_and_fsdp2_built_in_a_cell_train_in_step(c):
    pids = [r.pid for r in c.ranks]
    c.run(IN_SYNC, display=False)
    r = c.run("""
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
torch.manual_seed(0)
net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
fs = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
fully_shard(fs[0]); fully_shard(fs)
fs_opt = torch.optim.SGD(fs.parameters(), lr=0.05)
data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)),
                     torch.randn(64, 1, generator=torch.Generator().manual_seed(1)))
sampler = DistributedSampler(data, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)

def epoch(e):
    sampler.set_epoch(e)
    for x, y in loader:
        torch.nn.functional.mse_loss(net(x), y).backward(); zero.step(); zero.zero_grad()
        torch.nn.functional.mse_loss(fs(x), y).backward(); fs_opt.step(); fs_opt.zero_grad()

epoch(0)
_synced = (_same(net.module[0].weight), _same(fs[0].weight.full_tensor()))
""", display=False)
    assert r.ok and c.pull("_synced") == [(True, True)] * 2
    assert_whole(c, pids)  # reform and restart move net, zero and fs to the new group
    r = c.run("epoch(1)\n_synced = (_same(net.module[0].weight), _same(fs[0].weight.full_tensor()),"
              " net.process_group is dist.group.WORLD)", display=False)
    assert r.ok and c.pull("_synced") == [(True, True, True)] * 2


def test_what_a_cell_built_keeps_training_after_a_release(c):
    c.run(IN_SYNC, display=False)
    c.run("torch.manual_seed(0)\n"
          "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))\n"
          "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
          "def step():\n    m(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
          "step()", display=False)
    err, took = raise_before_all_reduce(c)
    assert took < QUICK_S and err.reformed
    assert "Moved to the new group: " in err.report
    assert "m: DistributedDataParallel rebuilt in place (same object)" in err.report
    r = c.run("step()\n_synced = _same(m.module.weight)", display=False)
    assert r.ok and c.pull("_synced") == [True, True]


def test_accelerate_prepare_and_backward_stay_in_step(c):
    pids = [r.pid for r in c.ranks]
    c.run(IN_SYNC, display=False)
    r = c.run(ACCELERATE_LOOP + """
accelerator.wait_for_everyone()
_acc = (accelerator.num_processes, accelerator.process_index,
        _same(accelerator.unwrap_model(model)[0].weight))
""", display=False)
    assert r.ok and c.pull("_acc") == [(2, 0, True), (2, 1, True)]
    # an uneven batch in gather (the classic last batch) is refused on every rank, not a SIGABRT
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run("accelerator.gather(torch.ones(3 + rank))", display=False)
    assert time.monotonic() - t0 < QUICK_S
    assert "called different collectives" in ei.value.report
    assert "rank 0: all_gather" in ei.value.report and "[4] float32" in ei.value.report
    assert not ei.value.reformed  # nothing ran, the group needed nothing
    assert_whole(c, pids)


def _by_hand(c, mode: str) -> dict:
    with open(script("handwritten.py")) as f:
        src = f.read()
    src = src.replace('default="zero"', f'default="{mode}"').replace("default=20", "default=5")
    res = c.run(src, display=False)
    return {r: o.stdout for r, o in res.outcomes.items()}


def test_data_parallelism_by_hand_matches_across_ranks_and_modes(c):
    pids = [r.pid for r in c.ranks]
    ddp, zero = _by_hand(c, "ddp"), _by_hand(c, "zero")
    sums = {out.split("checksum ")[1].split()[0] for out in [*ddp.values(), *zero.values()]}
    assert len(sums) == 1  # the replicas agree, and ZeRO-2 by hand equals DDP by hand
    assert_whole(c, pids)
