"""Code written the way GPU users write it, on one GPU under NCCL (world size 1).

A torchrun GPU script (``init_process_group("nccl")``, ``set_device(LOCAL_RANK)``,
``DDP(model, device_ids=[local_rank])``, ``destroy_process_group``) run by
``%dp run`` against the same script under real torchrun; DDP and FSDP2 built in
a cell that keep training on the GPU after the NCCL group is re-formed; an
Accelerate loop with bf16 autocast.  Each ends with the cluster whole.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.ecosystem import numbers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_nccl_train.py")


def _whole(c, pids):
    assert [r.pid for r in c.ranks] == pids and not c.dead
    r = c.run("_t = torch.ones(2, device=device)\ndist.all_reduce(_t)\n_w = _t.tolist()",
              display=False)
    assert r.ok and c.pull("_w") == [[1.0, 1.0]]


def test_a_torchrun_gpu_script_runs_by_dp_run_as_under_torchrun(gpu_cluster, tmp_path):
    c = gpu_cluster
    pids = [r.pid for r in c.ranks]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        "--standalone", SCRIPT, "--epochs", "2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    res = c.run_script(SCRIPT, ["--epochs", "2", "--checkpoint", str(tmp_path / "m.pt")],
                       display=False)
    out, err = res.outcomes[0].stdout, res.outcomes[0].stderr
    assert "world size 1, local rank 0, device 0" in out
    want = numbers(p.stdout, "loss")
    assert len(want) == 2 and numbers(out, "loss") == pytest.approx(want, rel=1e-4)
    assert "joined the cluster's running nccl group" in err
    assert "destroy_process_group() left the cluster's group up" in err
    _whole(c, pids)


def test_ddp_and_fsdp2_built_in_a_cell_keep_training_after_a_reform(gpu_cluster):
    c = gpu_cluster
    pids = [r.pid for r in c.ranks]
    r = c.run("""
import os
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(0)
own = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 1)).cuda(), device_ids=[local_rank])
own_opt = torch.optim.SGD(own.parameters(), lr=0.05)
fs = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)).cuda()
fully_shard(fs[0]); fully_shard(fs)
fs_opt = torch.optim.SGD(fs.parameters(), lr=0.05)
x = torch.randn(64, 8, device="cuda")
y = x @ torch.randn(8, 1, device="cuda")

def steps(n=3):
    for _ in range(n):
        torch.nn.functional.mse_loss(own(x), y).backward(); own_opt.step(); own_opt.zero_grad()
        torch.nn.functional.mse_loss(fs(x), y).backward(); fs_opt.step(); fs_opt.zero_grad()
    return (torch.nn.functional.mse_loss(own(x), y).item(),
            torch.nn.functional.mse_loss(fs(x), y).item())

_first = steps()
""", display=False)
    assert r.ok
    gen = c.generation
    c.reform()
    assert c.generation == gen + 1
    r = c.run("_second = steps()\n"
              "_where = (own.process_group is dist.group.WORLD, str(next(own.parameters()).device),"
              " str(fs[0].weight.to_local().device))", display=False)
    assert r.ok
    (first,), (second,) = c.pull("_first"), c.pull("_second")
    assert second[0] < first[0] and second[1] < first[1]  # both went on learning
    assert c.pull("_where") == [(True, "cuda:0", "cuda:0")]
    _whole(c, pids)


def test_an_accelerate_loop_with_bf16_on_the_gpu(gpu_cluster):
    c = gpu_cluster
    pids = [r.pid for r in c.ranks]
    r = c.run("""
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
accelerator = Accelerator(mixed_precision="bf16")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
_x = torch.randn(256, 8)
loader = DataLoader(TensorDataset(_x, _x @ torch.randn(8, 1)), batch_size=32)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for epoch in range(3):
    for xb, yb in loader:
        with accelerator.autocast():
            loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
_acc = (str(accelerator.device), accelerator.num_processes, str(xb.device),
        losses[-1] < losses[0])
""", display=False)
    assert r.ok
    assert c.pull("_acc") == [("cuda:0", 1, "cuda:0", True)]
    _whole(c, pids)
