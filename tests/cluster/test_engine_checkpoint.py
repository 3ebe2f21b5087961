"""Checkpoints move between strategies and world sizes without changing training.

Run A (2 ranks) trains under zero3 for 3 steps, saves, and keeps training 4
more steps: the uninterrupted losses.  Run A also does the same under zero1
(each rank holds part of the optimizer state).  Run B (2 ranks) builds the
model from a *different* seed, wraps it under ddp, loads the zero3 checkpoint
and trains 4 steps: the losses must be those of the uninterrupted run; then it
loads the zero1 checkpoint under zero3.  Run C has a single rank: it loads the
zero3 checkpoint under ddp and trains with twice the micro-batch (same global
batch of 12).  Adam is used so the optimizer state really matters.
"""

import json
import os

import pytest
import torch
import torch.nn as nn

from helpers.mp import run_ranks

from dpnb.data import SyntheticRegression

B, K = 3, 2
S1, S2 = 3, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 10)
        self.b = nn.Linear(10, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _setup(ns, seed, strategy):
    from dpnb.engine.train import training as T

    torch.manual_seed(seed)
    ns["net"] = Net()
    ns["ds"] = SyntheticRegression(48, 8, 4, seed=1)
    T.wrap(ns, "net", strategy, optimizer="adamw", lr=0.01, weight_decay=0.01)
    T.set_data(ns, "ds", seed=3)


def _save_runs(ns, d3, d1):
    from dpnb.engine.train import checkpoint as CK
    from dpnb.engine.train import training as T

    out = {}
    for strategy, d in (("zero3", d3), ("zero1", d1)):
        _setup(ns, 0, strategy)
        first = T.train(ns, steps=S1, micro_batch=B, grad_accum=K, publish=False)
        saved = CK.save(ns, d)
        after = T.train(ns, steps=S2, micro_batch=B, grad_accum=K, publish=False)
        out[strategy] = {"first": first["losses"], "after": after["losses"], "saved": saved}
    return out


def _load_runs(ns, d3, d1, micro_batch):
    from dpnb.engine.train import checkpoint as CK
    from dpnb.engine.train import training as T

    out = {}
    for strategy, d in (("ddp", d3), ("zero3", d1)):
        if d is None:
            continue
        _setup(ns, 123, strategy)
        loaded = CK.load(ns, d)
        res = T.train(ns, steps=S2, micro_batch=micro_batch, grad_accum=K, publish=False)
        out[strategy] = {"loaded": loaded, "losses": res["losses"],
                         "steps": [r["step"] for r in T.records(ns)], "global_batch": res["global_batch"]}
    # a checkpoint of another model is refused with a clear message
    torch.manual_seed(0)
    ns["other"] = nn.Linear(8, 4)
    T.wrap(ns, "other", "ddp", optimizer="adamw")
    try:
        CK.load(ns, d3)
        out["mismatch"] = None
    except T.TrainError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d3 = str(tmp_path_factory.mktemp("ck_zero3"))
    d1 = str(tmp_path_factory.mktemp("ck_zero1"))
    saved = run_ranks(_save_runs, d3, d1, timeout=240)
    loaded2 = run_ranks(_load_runs, d3, d1, B, timeout=240)
    loaded1 = run_ranks(_load_runs, d3, None, 2 * B, world_size=1, timeout=240)
    return {"d3": d3, "d1": d1, "saved": saved, "loaded2": loaded2, "loaded1": loaded1}


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)


def test_checkpoint_files_hold_no_pickled_objects(runs):
    meta = json.load(open(os.path.join(runs["d3"], "dpnb.json")))
    assert meta["step"] == S1 and meta["strategy"] == "zero3" and meta["world_size"] == 2
    # 3 steps of 12 out of 48 samples: position 36 in epoch 0
    assert meta["has_optimizer_state"] and meta["data"]["offset"] == 36 and meta["data"]["epoch"] == 0
    files = sorted(os.listdir(runs["d3"]))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "dpnb.json"]
    # only tensors went into DCP (nothing that would need unpickling on load),
    # and the allow-list reader can read the index
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dpnb.engine.train.checkpoint import SafeFileSystemReader

    md = SafeFileSystemReader(runs["d3"]).read_metadata()
    kinds = {type(v) for v in md.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata}
    keys = set(md.state_dict_metadata)
    assert {"model.a.weight", "optim.a.weight.exp_avg", "optim.a.weight.exp_avg_sq", "optim.a.weight.step"} <= keys
    assert md.state_dict_metadata["model.a.weight"].size == torch.Size([10, 8])


def test_zero3_checkpoint_continues_identically_under_ddp(runs):
    ref = runs["saved"][0]["zero3"]["after"]
    for rank in (0, 1):
        got = runs["loaded2"][rank]["ddp"]
        assert got["loaded"]["saved_strategy"] == "zero3" and got["loaded"]["step"] == S1
        assert _close(got["losses"], ref), (got["losses"], ref)
        assert got["steps"] == list(range(S1, S1 + S2))  # the step counter continues
    # a fresh model with another seed would not give these losses
    assert not _close(runs["saved"][0]["zero3"]["first"][:1], ref[:1])


def test_zero3_checkpoint_continues_identically_on_one_rank(runs):
    got = runs["loaded1"][0]["ddp"]
    assert got["loaded"]["saved_world_size"] == 2 and got["loaded"]["world_size"] == 1
    assert got["global_batch"] == 12
    assert _close(got["losses"], runs["saved"][0]["zero3"]["after"])


def test_zero1_partitioned_optimizer_state_loads_under_zero3(runs):
    ref = runs["saved"][0]["zero1"]["after"]
    for rank in (0, 1):
        got = runs["loaded2"][rank]["zero3"]
        assert got["loaded"]["saved_strategy"] == "zero1" and got["loaded"]["optimizer_state"]
        assert _close(got["losses"], ref), (got["losses"], ref)


def test_loading_another_models_checkpoint_is_refused(runs):
    msg = runs["loaded2"][0]["mismatch"]
    assert msg is not None and "saved from a different model" in msg
