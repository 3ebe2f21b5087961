"""ZeRO-2 vs ZeRO-3 memory measured *inside* the step, on two gloo ranks.

After a step both keep 1/N of the model; during it, ZeRO-2 keeps every
gathered unit from its forward to its backward, so at the end of the
forward a rank holds the whole model unsharded, while ZeRO-3 frees each
unit after its forward.  DDP holds the whole model throughout.  The probe
counts parameter and gradient storages at every module boundary of one real
training step.
"""

import torch

from helpers.mp import run_ranks

STRATEGIES = ("ddp", "zero2", "zero3")


def _measure(ns):
    import dpnb.data
    from dpnb.engine.metrics import residency
    from dpnb.engine.train import training as T

    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        ns["ds"] = dpnb.data.CharTextDataset(seq_len=16)
        ns["net"] = dpnb.data.TinyLM(ns["ds"].vocab_size, d_model=32, n_layers=4, n_heads=4, seq_len=16)
        T.wrap(ns, "net", strategy)
        T.set_data(ns, "ds")
        before = T.train_state(ns).step
        hooks = sum(len(m._forward_hooks) for m in T.train_state(ns).module.modules())
        r = residency.measure_step(ns, micro_batch=4)
        r["hooks_left"] = sum(len(m._forward_hooks) for m in T.train_state(ns).module.modules()) - hooks
        r["before"] = before
        out[strategy] = r
    return out


def test_zero3_holds_less_than_zero2_during_forward_and_backward():
    res = run_ranks(_measure)
    for rank, per in enumerate(res):
        full = per["ddp"]["full_param_bytes"]
        assert all(per[s]["full_param_bytes"] == full for s in STRATEGIES)
        for s in STRATEGIES:
            r = per[s]
            assert r["rank"] == rank and r["step"] == r["before"]  # one ordinary step was taken
            assert r["samples"]["forward"] > 4 and r["samples"]["backward"] > 4, r["samples"]
            assert r["hooks_left"] == 0  # the probe leaves nothing behind
        ddp, z2, z3 = (per[s]["peak"] for s in STRATEGIES)
        # DDP: the whole model, all the time (fp32, no sharding)
        assert ddp["forward"]["params"] == full
        # ZeRO-2: at the end of the forward every unit is gathered, plus the shards
        assert z2["forward"]["params"] >= full
        # ZeRO-3: never the whole model gathered at once
        assert z3["forward"]["params"] < 0.75 * z2["forward"]["params"], (z3, z2)
        assert z3["backward"]["total"] < z2["backward"]["total"], (z3, z2)
        # after the step both are back to their shards
        assert per["zero2"]["after"]["params"] == per["zero3"]["after"]["params"] < 0.75 * full
