"""dpnb's engine code on NCCL's CPU stand-in (:mod:`helpers.standin`).

Each test runs dpnb's own engine functions on real ranks whose group, like
NCCL's, serves the CUDA device type only, so a tensor that reaches a
collective on the CPU fails here as on the first machine with GPUs ("No
backend type associated with device type cpu") -- a gloo run passes either
way.  Values travel (the stand-in is gloo underneath), so the results are
checked, not just the absence of an error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.mp import run_ranks

NOT_CPU = "No backend type associated with device type cpu"


def _standin(fn, *args, world_size=2, **kwargs):
    return run_ranks(fn, *args, world_size=world_size, timeout=150, standin=True, **kwargs)


# ------------------------------------------------------------ the stand-in itself
def _calibrate(ns):
    out = {"comm_device": str(ns["_dpnb"].comm_device)}
    try:
        dist.all_reduce(torch.ones(1))
        out["cpu"] = "passed"
    except RuntimeError as e:
        out["cpu"] = str(e)
    t = torch.full((2,), float(ns["rank"] + 1), device="cuda")
    dist.all_reduce(t)
    out["cuda"] = (t.device.type, t.cpu().tolist())
    objs = [None] * ns["world_size"]
    dist.all_gather_object(objs, {"r": ns["rank"]})  # object collectives travel on "cuda"
    out["objects"] = objs
    return out


def test_standin_refuses_cpu_tensors_and_reduces_cuda_ones():
    """The tier's premise: a CPU tensor fails with NCCL's message, a "cuda"
    one is reduced across the ranks (1 + 2 = 3)."""
    for r in _standin(_calibrate):
        assert r["comm_device"] == "cuda:0"
        assert NOT_CPU in r["cpu"], r
        assert r["cuda"] == ("cuda", [3.0, 3.0])
        assert r["objects"] == [{"r": 0}, {"r": 1}]


# ------------------------------------------------------------ save and load
def _bind(ns, seed=0):
    """A model bound as dpnb's wrap would leave it, without DDP (whose CPU
    parameters the stand-in's group would refuse, as NCCL's does)."""
    from dpnb.engine.train.train_state import TrainState

    torch.manual_seed(seed)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    es = ns["_dpnb"]
    es.train = TrainState(strategy="ddp", config={"optimizer": "sgd", "mixed_precision": "none"},
                          model_name="m", model_out="m", optimizer_out="opt", module=m,
                          wrapped=m, optimizer=opt, world_size=es.world_size,
                          generation=es.generation, device=torch.device("cpu"))
    ns["m"] = m
    return m


def _save_load(ns, path):
    from dpnb.engine.train import checkpoint as CK

    m = _bind(ns)
    saved = CK.save(ns, path)
    before = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    loaded = CK.load(ns, path)
    return saved["n_model_tensors"], torch.equal(m.weight.detach(), before), sorted(loaded)


def test_save_and_load_on_an_nccl_like_group(tmp_path):
    """save's agreement on optimizer state (an all_reduce) and DCP's object
    collectives run on the communication device; load reads the weights back."""
    out = _standin(_save_load, str(tmp_path / "ck"))
    for n, same, keys in out:
        assert n == 2 and same, out
        assert keys, out


# ------------------------------------------------------------ the collective check
def _check(ns, differ):
    from dpnb.engine.train import check as C

    torch.manual_seed(0)
    ns["m"] = nn.Linear(4, 3)
    if differ and ns["rank"] == 1:
        with torch.no_grad():
            ns["m"].bias[1] += 1.0
    return C.check(ns, model_name="m")


@pytest.mark.parametrize("differ", [False, True])
def test_check_compares_ranks_through_the_comm_device(differ):
    out = _standin(_check, differ)
    assert [r["ok"] for r in out] == [not differ] * 2, out
    if differ:
        (bad,) = out[0]["mismatches"]
        assert bad["name"] == "bias" and bad["n_diff"] == 1 and bad["ranks_differing"] == [1]


# ------------------------------------------------------------ the step's stats gather
def _stats(ns):
    from dpnb.engine.train.step import _Loop

    es = ns["_dpnb"]
    loop = SimpleNamespace(cdev=es.comm_device, p=SimpleNamespace(world_size=es.world_size))
    _Loop.align(loop)
    loss = torch.tensor(0.5 + ns["rank"], device=es.device)  # the loss lives on the GPU
    work, gathered = _Loop.issue_stats(loop, loss, 0.25, 3 + ns["rank"], ns["rank"] == 1)
    work.wait()
    return gathered.cpu().tolist()


def test_step_stats_gather_every_ranks_four_values():
    for flat in _standin(_stats):
        assert flat == [0.5, 0.0, 0.25, 3.0, 1.5, 1.0, 0.25, 4.0]


# ------------------------------------------------------------ bench
def _bench(ns):
    from dpnb.engine.metrics import bench

    return {k: bench.bench_collective(ns, [64], k, iters=2, warmup=0) for k in bench.BENCH_KINDS}


def test_bench_times_each_collective_on_the_comm_device():
    """Each kind ran on the communication device, at the size asked (64 bytes:
    16 float32, a whole number per rank), and was timed once per iteration."""
    for out in _standin(_bench):
        assert sorted(out) == sorted(("all_reduce", "reduce_scatter", "all_gather")), out
        for kind, r in out.items():
            assert r["kind"] == kind and r["device"] == "cuda:0", r
            assert r["sizes"] == [64], r
            assert len(r["times"]) == 1 and len(r["times"][0]) == 2, r
            assert all(0 < t < 30 for t in r["times"][0]), r


def _ring(ns):
    from dpnb.engine.metrics import bench

    return bench.ring_demo(ns, numel=8)


def test_ring_demo_matches_all_reduce_on_the_comm_device():
    for ring in _standin(_ring):
        assert ring["equal"] and ring["max_abs_diff"] == 0.0, ring


# ------------------------------------------------------------ the profile
def _profile(ns):
    from dpnb.engine.metrics import profile as P

    P.begin(ns, "standin")
    t = torch.ones(256, device=ns["_dpnb"].comm_device)
    dist.all_reduce(t)
    rec, _blob = P.end(ns)
    return [(c.op, c.nbytes) for c in rec.comm]


def test_profile_extracts_the_collectives_of_an_nccl_like_group():
    """The all_reduce of 256 floats on the communication device comes out
    named, with its bytes, on every rank."""
    out = _standin(_profile)
    assert len(out) == 2
    for comm in out:
        # 256 float32 = 1024 bytes: exactly one all_reduce, of exactly those bytes
        assert [c for c in comm if c[0] == "all_reduce"] == [("all_reduce", 1024)], out


# ------------------------------------------------------------ a release's abort, then re-forming
class Holder:
    """A user's object keeping the group (``self.pg = dist.group.WORLD``)."""


def _abort_then_reform(ns):
    from dpnb import compat
    from dpnb.engine import setup

    es = ns["_dpnb"]
    es.group = dist.group.WORLD  # what form_group records
    setup.user_ns = lambda: ns  # no IPython kernel in this process: the namespace is ns
    h = ns["h"] = Holder()
    h.pg = old = dist.group.WORLD
    ns["pgs"] = {"world": old}
    port = [setup.listen_store() if es.rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    aborted = compat.abort_groups()  # the side door's release under NCCL
    gone = dist.is_initialized()
    out = setup.reform_group(port[0])
    new = dist.group.WORLD
    return {"aborted": aborted, "world_left": gone, "problems": out["problems"],
            "rebound": out["rebound"], "holder": h.pg is new and new is not old,
            "dict": ns["pgs"]["world"] is new, "recorded": es.group is new}


def test_release_abort_then_reform_rebinds_user_objects_by_identity():
    """Defect A: an NCCL release aborts every group (c10d's world map empty,
    no WORLD); the re-formation must still move what the user holds on the
    old group -- checked by identity: the holder's group *is* the new WORLD."""
    for r in _standin(_abort_then_reform):
        assert r["aborted"] is True and r["world_left"] is False, r
        assert r["problems"] == [], r
        assert r["holder"] and r["dict"], r
        assert r["rebound"], r
        assert r["recorded"], r  # form_group keeps the new group for the next release


# ------------------------------------------------------------ %dp run adoption
def _adopt(ns):
    from dpnb.engine.group import lifecycle

    es = ns["_dpnb"]
    lifecycle.install(es)
    before = dist.group.WORLD
    # a torchrun script's opening and closing lines, on the NCCL cluster
    dist.init_process_group("nccl")
    t = torch.ones(1).to(f"cuda:{ns['local_rank'] * 0}")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"same": dist.group.WORLD is before, "sum": t.item(), "backend": es.backend}


def test_run_adoption_keeps_the_nccl_group_for_the_script():
    for r in _standin(_adopt):
        assert r == {"same": True, "sum": 2.0, "backend": "nccl"}
