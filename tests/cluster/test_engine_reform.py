"""Training survives the process group being destroyed and re-formed.

For each strategy, on 2 gloo ranks: train 6 steps without interruption (the
reference); then train a fresh copy 3 steps, destroy the default group, form a
new one on another port, run the ``on_reform`` callbacks (what the lead's
recovery code does), and train 3 more.  The weights must equal the reference,
the optimizer must still hold the very same parameter objects, and every
wrapper must now talk over the *new* group (with gloo the old group object
keeps working after ``destroy_process_group``, so equal weights alone would
not prove the re-binding).
"""

import pytest
import torch
import torch.nn as nn

from helpers.mp import free_port, reform, run_ranks

from dpnb.data import SyntheticRegression

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))


def _start(ns, strategy):
    from dpnb.engine.train import training as T

    ns["net"] = _net()
    ns["ds"] = SyntheticRegression(48, 8, 4, seed=1)
    T.wrap(ns, "net", strategy, optimizer="adamw", lr=0.01)
    T.set_data(ns, "ds", seed=3)


def _groups_in_use(st):
    """The process-group objects the wrapper and optimizer hold."""
    groups = []
    if st.strategy in ("ddp", "zero1"):
        groups.append(st.wrapped.process_group)
        if st.strategy == "zero1":
            groups.append(st.optimizer.process_group)
    else:
        from dpnb.compat import fsdp_mesh_infos

        for info in fsdp_mesh_infos(st.module):
            groups.append(info.shard_process_group)
            groups.append(info.mesh.get_group())
        groups.append(st.mesh.get_group())
    return groups


def _run(ns, ports):
    import torch.distributed as dist

    from dpnb.engine.train import check as C
    from dpnb.engine.train import checkpoint as CK
    from dpnb.engine.train import training as T

    es = ns["_dpnb"]
    out = {}
    for strategy, port in zip(STRATEGIES, ports):
        _start(ns, strategy)
        ref = T.train(ns, steps=6, micro_batch=3, grad_accum=2, publish=False)["losses"]
        ref_sd = CK.full_state_dict(ns)

        _start(ns, strategy)
        st = T.train_state(ns)
        a = T.train(ns, steps=3, micro_batch=3, grad_accum=2, publish=False)["losses"]
        params_before = [id(p) for p in st.module.parameters()]
        opt_before = [id(p) for g in st.optimizer.param_groups for p in g["params"]]
        old_world = dist.group.WORLD
        old_model = ns["model"]
        bound_before = all(g is old_world for g in _groups_in_use(st))
        reform(ns, port)
        new_world = dist.group.WORLD
        bound_after = [g is new_world for g in _groups_in_use(st)]
        b = T.train(ns, steps=3, micro_batch=3, grad_accum=2, publish=False)["losses"]
        out[strategy] = {
            "ref": ref,
            "ref_sd": ref_sd,
            "losses": a + b,
            "sd": CK.full_state_dict(ns),
            "new_group": new_world is not old_world,
            "bound_before": bound_before,
            "bound_after": bound_after,
            "generation": (st.generation, es.generation),
            "same_params": params_before == [id(p) for p in st.module.parameters()],
            "same_opt_params": opt_before == [id(p) for g in st.optimizer.param_groups for p in g["params"]],
            "model_rebound": ns["model"] is st.wrapped,
            "new_ddp": ns["model"] is not old_model,
            "check": C.check(ns)["ok"],
            "callbacks": len(es.on_reform),
        }

    # Without the callback (e.g. fresh engines replaced dead ones) the stale
    # wrapper is refused with a clear message instead of used; rebind() on
    # every rank fixes it.
    _start(ns, "ddp")
    T.train(ns, steps=1, micro_batch=3, publish=False)
    es.on_reform.clear()
    reform(ns, ports[-1])
    try:
        T.train(ns, steps=1, micro_batch=3, publish=False)
        out["stale"] = None
    except T.TrainError as e:
        out["stale"] = str(e)
    out["rebind"] = T.rebind(ns)
    out["after_rebind"] = T.train(ns, steps=1, micro_batch=3, publish=False)["steps"]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, [free_port() for _ in range(len(STRATEGIES) + 1)], timeout=240)


def test_stale_wrapper_is_refused_until_rebound(results):
    for rank in (0, 1):
        r = results[rank]
        assert r["stale"] is not None and "re-formed" in r["stale"] and "%dp wrap" in r["stale"]
        assert r["rebind"]["rebound"] and r["after_rebind"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_continues_after_group_reform(results, strategy):
    for rank in (0, 1):
        r = results[rank][strategy]
        assert r["new_group"] and r["bound_before"]
        assert r["bound_after"] and all(r["bound_after"]), r["bound_after"]
        assert r["generation"][0] == r["generation"][1]
        assert r["callbacks"] == 1  # wrap registers its callback once
        assert r["same_params"] and r["same_opt_params"]
        assert r["model_rebound"]
        assert r["new_ddp"] == (strategy in ("ddp", "zero1"))
        assert r["check"]
        assert torch.allclose(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=1e-6, atol=1e-8)
    sd, ref = results[0][strategy]["sd"], results[0][strategy]["ref_sd"]
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(sd[k], ref[k], rtol=1e-6, atol=1e-7), k
