"""A release that aborts the process groups (what the side door does under NCCL).

Under NCCL the side door's release also calls torch's ``_abort_process_group``
(``dpnb.compat.abort_groups``), which empties c10d's world: no default group
at all.  No GPU here, but the abort does the same bookkeeping on a gloo group,
so this is the NCCL release path as far as a CPU can take it: after it, a
re-formation must give a working default group and move the user's own DDP
onto it -- not fail with "trying to initialize the default process group
twice!" or leave a stale, aborted WORLD behind.
"""

import pytest


def test_reform_after_an_aborting_release(healthy):
    c = healthy
    c.run("import torch.nn as nn\ntorch.manual_seed(0)\n"
          "net = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))\n"
          "net(torch.ones(3, 4)).sum().backward()", display=False)
    res = c.run("from dpnb import compat\nprint(compat.abort_groups(), dist.is_initialized())",
                display=False)
    assert all(res.stdout[r].split() == ["True", "False"] for r in res.ranks), res.stdout
    out = c.reform()
    assert out["problems"] == [], out
    c.run("x = torch.ones(1, device=device); dist.all_reduce(x)\nassert x.item() == 2",
          display=False)
    # the user's DDP trains on the new group (its all-reduce averages across ranks)
    c.run("net.zero_grad()\nnet(torch.full((3, 4), float(rank))).sum().backward()\n"
          "g = net.module.weight.grad.clone(); dist.all_reduce(g)\n"
          "assert torch.allclose(g / 2, net.module.weight.grad)", display=False)


@pytest.fixture(autouse=True)
def _no_stale_world(healthy):
    yield
    res = healthy.run("print(dist.is_initialized())", display=False)
    assert all(res.stdout[r].strip() == "True" for r in res.ranks)
