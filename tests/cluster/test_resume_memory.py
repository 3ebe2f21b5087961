"""``restart --resume`` with no checkpoint ever written: the replaced rank is
rebuilt from a survivor's replica (DDP), exactly -- every parameter and
optimizer tensor equal to the survivor's -- and training goes on from the step
the survivors had reached, the replicas in sync.  A sharded strategy has no
replica: the same command falls back to the disk checkpoint and, with none,
says why memory could not serve."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dpnb
from dpnb.errors import DpnbError, RemoteCellError

SETUP = ("import dpnb.data\n"
         "torch.manual_seed(0)\n"
         "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))\n"
         "ds = dpnb.data.SyntheticRegression(n=4096, in_dim=8, out_dim=1, seed=0)\n")

# every parameter, every optimizer-state tensor (by parameter order), step, data position
STATE = ("_o = optimizer.optimizer if hasattr(optimizer, 'optim') else optimizer\n"
         "_ps = [p for g in _o.param_groups for p in g['params']]\n"
         "_st = _dpnb.train\n"
         "state = ([p.detach().clone() for p in net.parameters()],\n"
         "         [{k: v.detach().clone() for k, v in sorted(_o.state[p].items())} for p in _ps],\n"
         "         _st.step, (_st.data.epoch, _st.data.offset), _o.param_groups[0]['lr'])\n")


def _kill_mid_training(c, rank: int) -> None:
    """SIGKILL ``rank`` while ``%dp train`` runs (as the OOM killer would)."""
    err: list = []

    def train():
        try:  # far more steps than run before the kill: it ends them
            c.train(steps=10**6, micro_batch=8, progress=False)
        except Exception as e:  # the assertion below says what it was
            err.append(e)

    t = threading.Thread(target=train)
    t.start()
    time.sleep(1.5)
    c.kill_rank(rank)
    t.join(120)
    assert err and isinstance(err[0], RemoteCellError) and rank in err[0].died, err


def _states(c, ranks=None) -> list:
    ranks = list(range(c.world_size)) if ranks is None else ranks
    c.run(STATE, ranks=ranks, display=False)
    return [c.pull("state", rank=r) for r in ranks]


def _equal(a, b) -> bool:
    params_a, opt_a, *rest_a = a
    params_b, opt_b, *rest_b = b
    return (rest_a == rest_b and len(params_a) == len(params_b) and len(opt_a) == len(opt_b)
            and all(torch.equal(x, y) for x, y in zip(params_a, params_b))
            and all(sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
                    for sa, sb in zip(opt_a, opt_b)))


def _kill_and_rebuild(c, dead: int) -> int:
    """Train, kill ``dead`` mid-training, resume from memory; the resumed step."""
    _kill_mid_training(c, dead)
    alive = [r for r in range(c.world_size) if r != dead]
    before = _states(c, alive)  # what the survivors hold: the replica
    step = before[0][2]
    assert step > 3 and all(_equal(s, before[0]) for s in before)
    src = alive[0]
    msg = c.restart(resume=True)
    assert (f"rank {dead} replaced; rebuilt from rank {src}'s replica at step {step:,} "
            f"(0 steps lost") in msg, msg
    after = _states(c)
    assert len(after[0][1][0]) > 0  # AdamW's state came over, not just the weights
    assert all(_equal(s, before[0]) for s in after)  # exactly the survivor's
    return step


def _scenario(c, dead: int) -> None:
    c.run(SETUP, display=False)
    c.wrap("net", "ddp", optimizer="adamw", lr=0.01)
    c.set_data("ds")
    c.train(steps=3, micro_batch=8, progress=False)
    step = _kill_and_rebuild(c, dead)
    again = c.train(steps=2, micro_batch=8, progress=False)
    assert again["first_step"] == step and again["steps"] == 2  # the curve goes on from there
    assert [r["step"] for r in c.call("dpnb.engine.training.records", last=2).values[dead]] == [step, step + 1]
    after = _states(c)
    assert all(_equal(s, after[0]) for s in after)  # replicas and optimizers in sync
    assert c.check()["ok"]


def test_ddp_rank_rebuilt_from_a_survivors_replica_two_ranks():
    with dpnb.start(2) as c:
        _scenario(c, dead=1)
        # zero1 shards the optimizer state: no replica, and no checkpoint -> refused, saying why
        c.wrap("net", "zero1", optimizer="adamw", lr=0.01)
        c.train(steps=2, micro_batch=8, progress=False)
        _kill_mid_training(c, 1)
        with pytest.raises(DpnbError) as ei:
            c.restart(resume=True)
        assert "no automatic checkpoint yet" in str(ei.value), ei.value
        assert "no replica to rebuild from: zero1 shards the optimizer state" in str(ei.value)
        assert 1 in c.dead  # nothing was replaced


def test_ddp_rank_0_rebuilt_from_rank_1_on_three_ranks():
    # rank 0 dies: a fresh DDP would broadcast the replaced rank 0's random weights
    with dpnb.start(3) as c:
        _scenario(c, dead=0)
