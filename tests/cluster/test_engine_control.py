"""Stopping, stragglers, progress, lr scaling, custom steps, mixed precision
and train-time errors, on 2 gloo ranks (one run for all of them)."""

import os
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.mp import run_ranks

from dpnb.data import CharTextDataset, SyntheticRegression, TinyLM
from dpnb.engine.proc.process import GC_EVERY

B, K = 2, 2
DELAY = 0.3


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _fresh(ns, strategy="ddp", lr=0.05):
    from dpnb.engine.train import training as T

    ns["net"] = _net()
    ns["ds"] = SyntheticRegression(40, 6, 3, seed=4)
    T.wrap(ns, "net", strategy, optimizer="sgd", lr=lr, momentum=0.9)
    T.set_data(ns, "ds", seed=2)


def _weights(ns):
    from dpnb.engine.train import training as T

    return {k: v.detach().clone() for k, v in T.train_state(ns).module.state_dict().items()}


def _errors(ns):
    from dpnb.engine.train import training as T

    msgs = {}
    for name, kw in {
        "too_big": dict(steps=1, micro_batch=25, grad_accum=1),
        "both_fns": dict(steps=1, micro_batch=2, step_fn=lambda b: 0, loss_fn=lambda o, t: 0),
        "no_length": dict(micro_batch=2),
        "missing_fn": dict(steps=1, micro_batch=2, loss_fn="nope"),
        "bad_scale": dict(steps=1, micro_batch=2, lr_scale="cubic"),
    }.items():
        try:
            T.train(ns, publish=False, **kw)
            msgs[name] = None
        except T.TrainError as e:
            msgs[name] = str(e)
    return msgs


def _run(ns, stop_path):
    from dpnb.engine.train import check as C
    from dpnb.engine.train import training as T

    rank = ns["rank"]
    es = ns["_dpnb"]
    out = {}

    # -- Ctrl-C: the reference runs 6 steps straight through
    _fresh(ns)
    T.train(ns, steps=6, micro_batch=B, grad_accum=K, publish=False)
    out["ref"] = _weights(ns)

    _fresh(ns)
    calls = {"n": 0}

    def step_fn(batch):  # also checks that a custom step gives the default result
        calls["n"] += 1
        if rank == 0 and calls["n"] == 5:  # first micro-batch of step 2
            os.kill(os.getpid(), signal.SIGINT)
        x, y = batch
        return F.mse_loss(ns["model"](x), y)

    handler_before = signal.getsignal(signal.SIGINT)
    s1 = T.train(ns, steps=6, micro_batch=B, grad_accum=K, step_fn=step_fn, publish=False)
    out["interrupted"] = s1
    out["handler_restored"] = signal.getsignal(signal.SIGINT) is handler_before
    out["check_after_interrupt"] = C.check(ns)["ok"]
    s2 = T.train(ns, steps=6 - s1["steps"], micro_batch=B, grad_accum=K, publish=False)
    out["resumed"] = s2
    out["resumed_w"] = _weights(ns)

    # -- Stop file (the Stop button); a file per rank, as on separate hosts,
    # and only rank 1's appears
    _fresh(ns)
    stop_path = f"{stop_path}.{rank}"
    es.stop_file = stop_path
    n2 = {"n": 0}

    def touch(batch):
        n2["n"] += 1
        if rank == 1 and n2["n"] == 3:  # during step 1
            open(stop_path, "w").close()
        x, y = batch
        return F.mse_loss(ns["model"](x), y)

    out["stop_file"] = T.train(ns, steps=5, micro_batch=B, grad_accum=K, step_fn=touch, publish=False)
    es.stop_file = None

    # -- the collector: off inside the call, collected at the same steps on every rank, back after
    import gc

    seen, collected = [], []

    def on_gc(phase, info):
        if phase == "start":
            collected.append((T.train_state(ns).step, info["generation"]))

    def gc_state(batch):
        seen.append(gc.isenabled())
        x, y = batch
        return F.mse_loss(ns["model"](x), y)

    gc.callbacks.append(on_gc)
    try:
        first = T.train_state(ns).step
        T.train(ns, steps=GC_EVERY + 2, micro_batch=B, step_fn=gc_state, publish=False)
    finally:
        gc.callbacks.remove(on_gc)
    out["gc"] = {"first": first, "seen": sorted(set(seen)), "after": gc.isenabled(),
                 "collected": collected}

    # -- a step returning its loss with shape (1,) (numel 1, not 0-dim): one
    # micro-batch and several, the same losses as the default step
    def shaped(batch):
        x, y = batch
        return F.mse_loss(ns["model"](x), y).reshape(1)

    out["shaped"] = {}
    for k in (1, K):
        for name, fn in (("default", None), ("shaped", shaped)):
            _fresh(ns)
            out["shaped"][name, k] = T.train(ns, steps=2, micro_batch=B, grad_accum=k,
                                             step_fn=fn, publish=False)["losses"]

    # -- straggler, progress publishing, lr scaling, loss_fn by name
    _fresh(ns)
    if rank == 1:
        es.straggle_delay_s = DELAY
    published = []
    ns["l1loss"] = lambda out_, target: F.l1_loss(out_, target)
    s = T.train(ns, steps=2, micro_batch=B, grad_accum=K, publish=published.append,
                lr_scale="linear", loss_fn="l1loss")
    es.straggle_delay_s = 0.0
    out["straggle"] = T.records(ns, last=2)
    out["published"] = published
    out["linear"] = s
    out["sqrt"] = T.train(ns, steps=1, micro_batch=B, grad_accum=K, publish=False, lr_scale="sqrt", ref_batch=2)
    out["none"] = T.train(ns, steps=1, micro_batch=B, grad_accum=K, publish=False)
    out["epochs"] = T.train(ns, epochs=1, micro_batch=B, grad_accum=K, publish=False)
    out["errors"] = _errors(ns)

    # -- check on a plain module by name; NaNs; differently built models
    ns["twin"] = _net()
    out["twin_ok"] = C.check(ns, model_name="twin")
    with torch.no_grad():
        ns["twin"][0].bias[1] = float("nan")  # the same NaN on both ranks is in sync
    out["twin_nan_same"] = C.check(ns, model_name="twin")
    with torch.no_grad():
        if rank == 1:
            ns["twin"][2].bias[0] = float("nan")
    out["twin_nan_one"] = C.check(ns, model_name="twin")
    ns["twin"] = nn.Linear(6, 3 + rank)
    out["twin_shape"] = C.check(ns, model_name="twin")

    # -- FSDP accumulates without reduce-scatter until the last micro-batch:
    # when the last micro-batch's forward runs, no sharded .grad exists yet.
    for strategy in ("zero2", "zero3"):
        _fresh(ns, strategy)
        seen = []

        def probe(batch):
            seen.append(all(p.grad is None for p in T.train_state(ns).module.parameters()))
            x, y = batch
            return F.mse_loss(ns["model"](x), y)

        T.train(ns, steps=2, micro_batch=B, grad_accum=3, step_fn=probe, publish=False)
        grads_after = [p.grad is None for p in T.train_state(ns).module.parameters()]
        out[f"probe_{strategy}"] = (seen, grads_after)

    # -- TinyLM on the shipped text: zero3 per block with bf16, ddp with bf16 autocast
    ns["text"] = CharTextDataset(seq_len=16)
    for strategy in ("zero3", "ddp"):
        torch.manual_seed(0)
        ns["lm"] = TinyLM(ns["text"].vocab_size, d_model=16, n_layers=2, n_heads=2, seq_len=16)
        w = T.wrap(ns, "lm", strategy, mixed_precision="bf16", optimizer="adamw", lr=3e-3)
        T.set_data(ns, "text", seed=0)
        r = T.train(ns, steps=3, micro_batch=2, grad_accum=1, publish=False)
        out[f"lm_{strategy}"] = {"wrap": w, "train": r, "records": T.records(ns), "check": C.check(ns)["ok"]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    stop = str(tmp_path_factory.mktemp("stop") / "STOP")
    return run_ranks(_run, stop, timeout=240)


def test_ctrl_c_stops_all_ranks_at_a_step_boundary_and_keeps_state(results):
    r0, r1 = results
    for r, reason in ((r0, "interrupt"), (r1, "stopped_by_other_rank")):
        s = r["interrupted"]
        assert s["interrupted"] and s["stop_reason"] == reason
        # Ctrl-C came during step 2; every rank learns of it with step 2's
        # stats, which are read after step 3, so all stop after step 3
        assert s["steps"] == 4 and s["last_step"] == 3
        assert r["handler_restored"] and r["check_after_interrupt"]
        assert r["resumed"]["first_step"] == 4 and not r["resumed"]["interrupted"]
        # interrupted + resumed == uninterrupted, exactly
        for k, v in r["ref"].items():
            assert torch.equal(r["resumed_w"][k], v), k


def test_stop_file_seen_by_one_rank_stops_both(results):
    assert results[1]["stop_file"]["stop_reason"] == "stop_file"
    assert results[0]["stop_file"]["stop_reason"] == "stopped_by_other_rank"
    # the file appeared in step 1: both ranks stop after step 2
    assert results[0]["stop_file"]["steps"] == results[1]["stop_file"]["steps"] == 3


def test_straggler_delay_shows_in_compute_times(results):
    for rank in (0, 1):
        for rec in results[rank]["straggle"]:
            c0, c1 = rec["compute_s_all"]
            assert c1 >= DELAY and c0 < DELAY / 2
            assert rec["step_time_s"] >= DELAY  # rank 0 waited for rank 1 in the sync
            assert rec["straggle_delay_s"] == (DELAY if rank == 1 else 0.0)


def test_the_collector_runs_at_the_same_steps_on_every_rank(results):
    g0, g1 = results[0]["gc"], results[1]["gc"]
    assert g0["seen"] == g1["seen"] == [False]  # no automatic collection inside the call
    assert g0["after"] and g1["after"]
    # only the scheduled young-generation collection, at the step it is due (step_idx + 1
    # divisible by GC_EVERY), the same on both ranks
    due = [s for s in range(g0["first"], g0["first"] + GC_EVERY + 2) if (s + 1) % GC_EVERY == 0]
    assert g0["collected"] == g1["collected"] == [(s, 1) for s in due], g0["collected"]


def test_a_loss_shaped_1_trains_like_a_0_dim_one(results):
    for r in results:
        got = r["shaped"]
        for k in (1, K):
            assert len(got["shaped", k]) == 2
            assert got["shaped", k] == got["default", k], k


def test_progress_publishing(results):
    pub = results[0]["published"]
    assert pub, "nothing published"
    last = pub[-1]["dpnb_progress"]
    assert last["done"] == last["total"] == 2 and last["step"] == 1
    assert set(last) >= {"loss", "samples_per_s", "tokens_per_s", "step_time_s", "history", "compute_s_all"}
    # each publish carries the recent history, so the last one has every step
    assert [h[0] for h in last["history"]] == [0, 1]
    assert all(p["dpnb_progress"]["history"][-1][0] == p["dpnb_progress"]["step"] for p in pub)
    # progress is the same on every rank: rank 0 alone sends it
    assert results[1]["published"] == []


def test_lr_scaling(results):
    r = results[0]
    g = 2 * B * K
    assert r["linear"]["global_batch"] == g
    assert r["linear"]["lr"] == pytest.approx(0.05 * g / B)  # ref_batch defaults to micro_batch
    assert r["sqrt"]["lr"] == pytest.approx(0.05 * (g / 2) ** 0.5)
    assert r["none"]["lr"] == pytest.approx(0.05)
    assert [rec["lr"] for rec in results[0]["straggle"]] == pytest.approx([0.05 * g / B] * 2)


def test_epochs(results):
    # 40 samples, 20 per rank, 4 per rank per step: 5 steps make an epoch
    e = results[0]["epochs"]
    assert e["steps"] == e["steps_per_epoch"] == 5 and e["first_step"] == 4


def test_train_errors_say_what_to_do(results):
    e = results[0]["errors"]
    assert "40 samples" in e["too_big"] and "each of the 2 ranks gets 20" in e["too_big"]
    assert "25 x 1 = 25 per rank" in e["too_big"] and "global batch 25 x 2 ranks x 1 = 50" in e["too_big"]
    assert "smaller --micro-batch" in e["too_big"]
    assert "either step_fn or loss_fn" in e["both_fns"]
    assert "--steps S or --epochs E" in e["no_length"]
    assert "no function 'nope'" in e["missing_fn"]
    assert "unknown lr scaling 'cubic'" in e["bad_scale"]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fsdp_accumulation_defers_gradient_sync(results, strategy):
    seen, after = results[0][f"probe_{strategy}"]
    # 2 steps x 3 micro-batches: no sharded gradient exists during a step
    # (they are accumulated unsharded, without reduce-scatter)...
    assert seen == [True] * 6
    # ...and zero_grad(set_to_none) cleared the reduced ones after the step
    assert all(after)


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_tiny_lm_bf16_on_shipped_text(results, strategy):
    for rank in (0, 1):
        r = results[rank][f"lm_{strategy}"]
        assert r["check"]
        if strategy == "zero3":
            assert r["wrap"]["fsdp_units"] == ["blocks.1", "blocks.0"]
        losses = r["train"]["losses"]
        assert len(losses) == 3 and all(0 < x < 10 for x in losses)
        for rec in r["records"]:
            assert rec["tokens"] == rec["global_batch"] * 16 == 64
            assert rec["tokens_per_s"] > 0
        assert r["train"]["tokens_per_s"] > 0


def test_check_by_name_nan_and_structure(results):
    for rank in (0, 1):
        r = results[rank]
        assert r["twin_ok"]["ok"] and r["twin_ok"]["strategy"] == "unwrapped"
        assert r["twin_nan_same"]["ok"]
        bad = r["twin_nan_one"]
        assert not bad["ok"] and [m["name"] for m in bad["mismatches"]] == ["2.bias"]
        assert bad["mismatches"][0]["ranks_differing"] == [1] and bad["mismatches"][0]["n_diff"] == 1
        shape = r["twin_shape"]
        assert not shape["ok"] and "differently built models" in shape["error"]
