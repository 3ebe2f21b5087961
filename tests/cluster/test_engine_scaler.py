"""Issue 29, defect 8 (fp16 under FSDP): every rank skips the same steps.

Under ZeRO-2/3 each rank holds a shard of the gradients, so an overflow is
seen by one rank only.  A per-rank ``GradScaler`` then steps on the ranks
that saw none and skips on the one that did: the shards part ways with no
error (shown first, on 2 gloo ranks).  dpnb's fp16 FSDP wrap now takes
torch's ``ShardedGradScaler`` on the mesh's group, which all-reduces the
overflow flags (moved onto the device where the shards are offloaded to the
CPU), and points it at the new group after a re-form.  fp16 itself needs a
GPU: the wrap's fp16 refusal is lifted for the wiring check only.  The
re-form comes before any step: re-binding an FSDP model that never ran used
to raise in FSDP's ``reset_iter_state`` (its lazy state not built yet).
"""

import torch

from helpers.mp import reform, run_ranks


def _overflow_on_rank_1(rank, scaler):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum() * (float("inf") if rank == 1 else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    return p.detach().tolist(), scaler.get_scale()


def _run(ns):
    import torch.distributed as dist

    from dpnb.engine import device
    from dpnb.engine.train import training as T
    from dpnb.engine.train import wrap as W

    rank = ns["rank"]
    out = {"per_rank": _overflow_on_rank_1(rank, device.grad_scaler("cpu")),
           "sharded": _overflow_on_rank_1(rank, device.grad_scaler("cpu", dist.group.WORLD))}

    torch.manual_seed(0)
    ns["net"] = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    W._check_wrap_args = lambda *a: None  # fp16 on the CPU: only to build the wrap here
    T.wrap(ns, "net", "zero2", mixed_precision="fp16")
    st = T.train_state(ns)
    out["scaler"] = type(st.scaler).__name__
    out["on_mesh_group"] = st.scaler.process_group is st.mesh.get_group()
    reform(ns)
    out["after_reform"] = st.scaler.process_group is dist.group.WORLD
    return out


def test_fp16_under_fsdp_skips_the_same_steps_on_every_rank():
    r0, r1 = run_ranks(_run, timeout=120)
    # a scaler per rank: rank 0 stepped, rank 1 skipped and halved its scale
    assert r0["per_rank"][0] != r1["per_rank"][0] and r0["per_rank"][1] != r1["per_rank"][1]
    assert r0["sharded"] == r1["sharded"] == ([1.0, 1.0, 1.0], 32768.0)
    for r in (r0, r1):
        assert r["scaler"] == "ShardedGradScaler" and r["on_mesh_group"] and r["after_reform"]
