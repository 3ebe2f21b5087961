"""Every strategy trains exactly like one process on the global batch.

One 2-rank gloo run trains the same fixed-seed model under ddp, zero1, zero2
and zero3 with micro-batch B=3 and grad-accum K=2 for 5 steps (crossing an
epoch boundary, so ``set_epoch`` matters).  The parent process trains the same
model with plain SGD on the global batches of 2*B*K=12 samples, which it
derives independently from ``DistributedSampler``.  Weights and the reported
losses must agree.  ``check`` must pass after training and, when rank 1's
copy of a parameter (ddp/zero1) or of a replicated buffer (zero2/zero3) is
perturbed, fail naming that tensor.
"""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from helpers.mp import run_ranks

from dpnb.data import SyntheticRegression

N, IN, OUT = 48, 8, 4
B, K, STEPS, WS = 3, 2, 5, 2
LR, MOM, WD = 0.05, 0.9, 0.01
DATA_SEED, SAMPLER_SEED, MODEL_SEED = 1, 3, 0
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(IN, 16)
        self.l2 = nn.Linear(16, 12)
        self.l3 = nn.Linear(12, OUT)
        self.register_buffer("scale", torch.tensor([1.0, 0.5, 2.0, 1.5]))

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))) * self.scale


def make_net():
    torch.manual_seed(MODEL_SEED)
    return Net()


def _run_all(ns):
    from dpnb.engine.train import check as C
    from dpnb.engine.train import checkpoint as CK
    from dpnb.engine.train import training as T
    from dpnb.engine.train.measure import local_tensor

    rank = ns["rank"]
    out = {}
    for strategy in STRATEGIES:
        ns["net"] = make_net()
        ns["ds"] = SyntheticRegression(N, IN, OUT, seed=DATA_SEED)
        T.wrap(ns, "net", strategy, optimizer="sgd", lr=LR, momentum=MOM, weight_decay=WD)
        T.set_data(ns, "ds", seed=SAMPLER_SEED)
        summary = T.train(ns, steps=STEPS, micro_batch=B, grad_accum=K, publish=False)
        recs = T.records(ns)
        good = C.check(ns)
        sd = CK.full_state_dict(ns)
        st = T.train_state(ns)
        res = {"summary": summary, "records": recs, "good": good, "sd": sd,
               "model_is_ns": ns["model"] is st.wrapped, "opt_is_ns": ns["optimizer"] is st.optimizer}
        with torch.no_grad():
            if strategy in ("ddp", "zero1"):
                if rank == 1:
                    st.module.l2.weight[0, 0] += 1e-3
                res["bad"] = C.check(ns)
            else:
                # A shard has no replica: changing it is not a desync, but the
                # gathered checksum must move, identically on both ranks.
                if rank == 1:
                    local_tensor(st.module.l2.weight)[0, 0] += 1e-3
                res["shard_changed"] = C.check(ns)
                if rank == 1:
                    st.module.scale[1] += 1e-3
                res["bad"] = C.check(ns)
        out[strategy] = res
    return out


def _global_batches():
    ds = SyntheticRegression(N, IN, OUT, seed=DATA_SEED)
    per_step = B * K
    spe = (N // WS) // per_step
    batches = []
    for s in range(STEPS):
        epoch, j = divmod(s, spe)
        idx = []
        for r in range(WS):
            smp = DistributedSampler(ds, num_replicas=WS, rank=r, shuffle=True, seed=SAMPLER_SEED, drop_last=True)
            smp.set_epoch(epoch)
            idx += list(smp)[j * per_step:(j + 1) * per_step]
        batches.append(idx)
    return ds, batches


def _reference(rank_only=None):
    ds, batches = _global_batches()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOM, weight_decay=WD)
    losses = []
    for idx in batches:
        assert len(idx) == WS * B * K == 12
        if rank_only is not None:  # a wrong recipe, for the negative control
            idx = idx[:B * K]
        loss = F.mse_loss(net(ds.x[idx]), ds.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run_all, timeout=240)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_reference_is_sensitive(reference):
    ref_sd, _ = reference
    wrong_sd, _ = _reference(rank_only=0)
    init = make_net().state_dict()
    assert (ref_sd["l1.weight"] - init["l1.weight"]).abs().max() > 1e-2  # training moved the weights
    assert (ref_sd["l1.weight"] - wrong_sd["l1.weight"]).abs().max() > 1e-4  # far beyond the tolerance


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_process_global_batch(results, reference, strategy):
    ref_sd, ref_losses = reference
    r0, r1 = results[0][strategy], results[1][strategy]
    s = r0["summary"]
    assert s["steps"] == STEPS and s["global_batch"] == 12 and s["dp"] == 2
    assert s["micro_batch"] == B and s["grad_accum"] == K and s["epoch"] == 1
    assert r0["model_is_ns"] and r0["opt_is_ns"]
    assert [r["step"] for r in r0["records"]] == list(range(STEPS))
    assert all(r["global_batch"] == r["samples"] == 12 for r in r0["records"])
    # the reported loss is the global-batch mean loss, the same on both ranks
    assert torch.allclose(torch.tensor(s["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    assert r1["summary"]["losses"] == s["losses"]
    sd = r0["sd"]
    assert sorted(sd) == sorted(ref_sd) and results[1][strategy]["sd"] == {}
    for k, v in ref_sd.items():
        assert sd[k].shape == v.shape
        assert torch.allclose(sd[k], v, rtol=1e-5, atol=1e-6), (strategy, k, (sd[k] - v).abs().max())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_check_passes_then_names_the_perturbed_tensor(results, strategy):
    for rank in (0, 1):
        res = results[rank][strategy]
        good, bad = res["good"], res["bad"]
        assert good["ok"] and good["mismatches"] == [] and good["n_tensors"] == 7
        assert not bad["ok"] and bad["n_mismatched"] == 1
        m = bad["mismatches"][0]
        assert m["ranks_differing"] == [1]
        assert abs(m["max_abs_diff"] - 1e-3) < 1e-5
        assert m["n_diff"] == 1
        if strategy in ("ddp", "zero1"):
            assert (m["name"], m["kind"], m["sharded"]) == ("l2.weight", "parameter", False)
            assert good["sharded"] == []
        else:
            assert (m["name"], m["kind"]) == ("scale", "buffer")
            assert sorted(good["sharded"]) == sorted(
                f"{l}.{p}" for l in ("l1", "l2", "l3") for p in ("weight", "bias"))
            sc = res["shard_changed"]
            assert sc["ok"]
            moved = sc["checksums"]["l2.weight"] - good["checksums"]["l2.weight"]
            assert abs(moved - 1e-3) < 1e-5
    if strategy in ("zero2", "zero3"):
        assert results[0][strategy]["shard_changed"]["checksums"] == results[1][strategy]["shard_changed"]["checksums"]
