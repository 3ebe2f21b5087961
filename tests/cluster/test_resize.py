"""``%dp resize``: a real 2-rank job goes to 3 ranks and back, and trains on as one process would.

A fixed-seed MLP is trained with DDP (SGD with momentum, so the optimizer
state must travel too) at micro-batch 2 x DP 2 x grad-accum 3 = 12.  The
parent process trains the same model on the same global batches of 12
samples (the first 12*s samples of the epoch's permutation, which is what
dpnb's global data position means).  After each resize the next step's loss
and the weights must match that one process, ``check`` must pass, the step
must continue, and the global batch must still be micro x DP x accum = 12.
"""

import os

import psutil
import pytest
import torch
import torch.nn.functional as F
from helpers.shell import magics_on

import dpnb
import dpnb.session.resize
from dpnb.errors import DpnbError

SETUP = """
import torch, dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=240, in_dim=8, out_dim=2, seed=1)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
"""
LR, MOM, SEED, G = 0.05, 0.9, 3, 12


def _reference(steps: int):
    ns: dict = {}
    exec(SETUP, ns)
    net, ds = ns["net"], ns["ds"]
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOM)
    g = torch.Generator()
    g.manual_seed(SEED)  # DistributedSampler's permutation of epoch 0
    perm = torch.randperm(len(ds), generator=g).tolist()
    losses = []
    for s in range(steps):
        idx = perm[s * G:(s + 1) * G]
        loss = F.mse_loss(net(ds.x[idx]), ds.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@pytest.fixture(scope="module")
def c():
    c = dpnb.start(2, timeout=10.0)
    yield c
    c.stop()


def _three_steps(c, check_refusals: bool = False) -> None:
    """The model wrapped and trained 3 steps (once per module's cluster: each test
    run alone, as the break checker runs it, finds it so)."""
    if c.setup_log.wrapped:
        return
    c.run(SETUP, display=False, setup=True)
    if check_refusals:
        with pytest.raises(DpnbError, match="no model was wrapped"):
            c.resize(3)
    c.wrap("net", "ddp", optimizer="sgd", lr=LR, momentum=MOM)
    c.set_data("ds", seed=SEED)
    if check_refusals:
        with pytest.raises(DpnbError, match="no training step has run yet"):
            c.resize(3)
    s = c.train(steps=3, micro_batch=2, grad_accum=3, progress=False)
    assert s["global_batch"] == G and s["last_step"] == 2


def test_resize_refuses_bad_input_and_changes_nothing(c):
    assert not c.setup_log.wrapped  # the module's first test: the refusals before a wrap
    _three_steps(c, check_refusals=True)
    pids = [r.pid for r in c.ranks]
    for bad, msg in ((0, "whole number of ranks >= 1"), (2, "already has 2 ranks"),
                     (1000, "more ranks than the local launcher can place"),
                     (5, "cannot be split over 5 ranks")):
        with pytest.raises(DpnbError, match=msg):
            c.resize(bad)
    assert [r.pid for r in c.ranks] == pids and c.world_size == 2 and c.check()["ok"]


def test_resize_2_3_2_trains_on_like_one_process(c):
    _three_steps(c)
    ref_losses, ref_sd = _reference(5)
    assert c.world_size == 2
    last = c.ranks[-1]
    up = c.resize(3)
    assert up["old"] == 2 and up["new"] == 3 and up["added"] == [2]
    assert "resized 2 -> 3 ranks at step 3" in up["summary"], up["summary"]
    assert "global batch 12 kept = 2 x DP 3 x grad-accum 2" in up["summary"]
    assert c.world_size == 3 and c.check()["ok"]
    assert c.pull("world_size") == [3, 3, 3] and c.pull("rank") == [0, 1, 2]
    s = c.train(steps=1, progress=False)  # the batch layout comes from the resize
    assert s["first_step"] == 3 and s["dp"] == 3 and s["grad_accum"] == 2
    assert s["global_batch"] == s["micro_batch"] * s["dp"] * s["grad_accum"] == G
    assert "global batch 12 kept" in s["batch_note"]
    assert _close(s["loss"], ref_losses[3]), (s["loss"], ref_losses[3])
    assert c.check()["ok"]

    added_pid = c.ranks[2].pid
    down = c.resize(2)
    assert down["removed"] == [2] and "resized 3 -> 2 ranks at step 4" in down["summary"]
    assert not psutil.pid_exists(added_pid) or psutil.Process(added_pid).status() == "zombie"
    assert c.ranks[-1].pid == last.pid  # the survivors are the engines that were there
    s = c.train(steps=1, progress=False)
    assert s["first_step"] == 4 and s["dp"] == 2 and s["grad_accum"] == 3
    assert s["global_batch"] == G
    assert _close(s["loss"], ref_losses[4]), (s["loss"], ref_losses[4])
    assert c.check()["ok"]
    got = c.pull_model()
    for k, v in ref_sd.items():
        assert torch.allclose(got[k], v, atol=1e-5), k
    # the hand-over checkpoints live in the profile (a stop removes it with its
    # keys: tests/cluster/test_lifecycle.py), one folder per resize
    for info in (up, down):
        assert os.path.dirname(info["checkpoint"]) == c.profile_dir, info["checkpoint"]
        assert os.path.basename(info["checkpoint"]).startswith("resize-")
        assert os.path.isfile(os.path.join(info["checkpoint"], ".metadata"))
    assert up["checkpoint"] != down["checkpoint"]


def test_resize_magic_says_one_line(c, capsys):
    with magics_on(c) as ip:
        with pytest.raises(Exception, match="-n must be a whole number of ranks"):
            ip.run_line_magic("dp", "resize -n 0")
        ip.run_line_magic("dp", "resize -n 3 --scale-lr linear")
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "resized 2 -> 3 ranks" in out[0], out
        assert "global batch 12 -> 18" in out[0] and "learning rate x 1.5" in out[0], out
        c.run("lr_now = optimizer.param_groups[0]['lr']", display=False)
        assert c.pull("lr_now") == [pytest.approx(LR * 1.5)] * 3
        assert c.check()["ok"] and c.world_size == 3
    # a train with a layout of its own makes the resize plan history: the next
    # resize keeps the batch that last trained (4 x DP 3 x 1 = 12), not the plan's 18
    c.train(steps=1, micro_batch=4, grad_accum=1, progress=False)
    p = dpnb.session.resize.plan(c, 2)
    assert (p.old_global_batch, p.micro_batch, p.grad_accum) == (12, 3, 2)
