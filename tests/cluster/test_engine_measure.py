"""Per-rank model-state bytes and DDP bucket timelines, on 2 gloo ranks.

Bytes are measured by the training loop right after ``optimizer.step()``
(before ``zero_grad``) for a model whose shapes make every case visible: a
parameter with an odd dim 0 (FSDP pads its shard) and parameters of distinct
sizes (ZeroRedundancyOptimizer's greedy partition is unambiguous).  Expected
counts are derived here from the shapes; they are also compared with the pure
model ``dpnb.core.exact_memory.exact_rank_bytes``.
"""

import math

import pytest
import torch
import torch.nn as nn

from helpers.mp import run_ranks

from dpnb.data import SyntheticRegression

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
SHAPES = {"l1.weight": (14, 8), "l1.bias": (14,), "l2.weight": (5, 14), "l2.bias": (5,)}
# ZeroRedundancyOptimizer: largest first, each to the least-loaded rank
# (112 -> r0; 70 -> r1; 14 -> r1 (70 < 112); 5 -> r1 (84 < 112)).
ZERO1_OWNED = [["l1.weight"], ["l1.bias", "l2.bias", "l2.weight"]]


class MNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 14)
        self.l2 = nn.Linear(14, 5)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def _measure(ns):
    from dpnb.engine.train import training as T
    from dpnb.engine.train.measure import local_tensor
    from dpnb.engine.train.training import bucket_records, measure_state_bytes

    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        ns["net"] = MNet()
        ns["ds"] = SyntheticRegression(32, 8, 5, seed=2)
        T.wrap(ns, "net", strategy, optimizer="adamw", lr=1e-3)
        T.set_data(ns, "ds")
        T.train(ns, steps=1, micro_batch=4, publish=False, record=True)
        st = T.train_state(ns)
        names = {id(p): n for n, p in st.module.named_parameters()}
        inner = getattr(st.optimizer, "optim", st.optimizer)
        out[strategy] = {
            "after_step": T.records(ns)[-1]["bytes"],
            "between_steps": measure_state_bytes(ns),
            "owned": sorted(names[id(p)] for p in inner.state),
            "local_shapes": {n: tuple(local_tensor(p).shape) for n, p in st.module.named_parameters()},
        }

    # DDP buckets: 4 layers of 16x16+16 floats (1088 B each), a cap of
    # ~0.94 kB (a bucket closes once it reaches the cap) gives one bucket per layer.
    torch.manual_seed(0)
    ns["deep"] = Deep()
    ns["ds16"] = SyntheticRegression(64, 16, 16, seed=3)
    T.wrap(ns, "deep", "ddp", bucket_cap_mb=0.0009, optimizer="sgd", lr=0.01)
    T.set_data(ns, "ds16")
    T.train(ns, steps=3, micro_batch=4, grad_accum=2, publish=False, record=True)
    on = bucket_records(ns)
    T.train(ns, steps=1, micro_batch=4, grad_accum=2, publish=False, record=False)
    off = bucket_records(ns)
    last = T.records(ns, last=2)
    st = T.train_state(ns)
    # the default records sampled steps: steps 4..15 keep 10 and 15 (the call's last)
    T.train(ns, steps=12, micro_batch=4, publish=False)
    sampled = [s["step"] for s in bucket_records(ns)][3:]
    hooks_after = sum(len(p._post_accumulate_grad_hooks or {}) for p in st.module.parameters())
    # The allocator is read (its peak reset first) only on the steps that count
    # their bytes: each reading builds its whole stats dict (75-80 us on a GPU host)
    from dpnb.engine import device as D

    first, resets, real = st.step, [], D.reset_peak_memory
    D.reset_peak_memory = lambda dev: resets.append(st.step)
    try:
        T.train(ns, steps=30, micro_batch=4, publish=False, record=True)
    finally:
        D.reset_peak_memory = real
    counted_at = [r["bytes"]["counted_at_step"] for r in T.records(ns, last=30)]
    out["bytes_read"] = {"first": first, "resets": resets, "counted_at": counted_at}
    out["buckets"] = {
        "on": on, "n_after_off": len(off), "last_records": last, "sampled": sampled,
        "hooks_after": hooks_after,
        "grad_bytes": sum(p.numel() * p.element_size() for p in st.module.parameters()),
        "names": [n for n, _ in st.module.named_parameters()],
    }
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_measure, timeout=240)


def _expected(strategy, rank, ws=2):
    numel = {n: math.prod(s) for n, s in SHAPES.items()}
    if strategy in ("ddp", "zero1"):
        full = 4 * sum(numel.values())
        owned = list(SHAPES) if strategy == "ddp" else ZERO1_OWNED[rank]
        opt = sum(2 * 4 * numel[n] + 4 for n in owned)  # exp_avg, exp_avg_sq, float32 step
        return {"params": full, "grads": full, "optimizer": opt}
    params = opt = 0
    for n, s in SHAPES.items():
        chunk = math.ceil(s[0] / ws)
        rows = max(0, min(chunk, s[0] - rank * chunk))
        row = math.prod(s[1:])
        params += 4 * chunk * row  # every rank stores the padded chunk
        opt += 2 * 4 * rows * row + 4  # state is zeros_like(the unpadded local shard)
    return {"params": params, "grads": params, "optimizer": opt}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_bytes_exact(measured, strategy):
    full = 4 * sum(math.prod(s) for s in SHAPES.values())
    for rank in (0, 1):
        m = measured[rank][strategy]
        got = m["after_step"]
        exp = _expected(strategy, rank)
        assert {k: got[k] for k in exp} == exp, (strategy, rank)
        assert got["total"] == sum(exp.values())
        # between steps gradients are freed (set_to_none); the rest stays
        now = m["between_steps"]
        assert (now["params"], now["grads"], now["optimizer"]) == (exp["params"], 0, exp["optimizer"])
        if strategy == "zero1":
            assert m["owned"] == ZERO1_OWNED[rank]  # whole parameters, greedy by size
        if strategy in ("zero2", "zero3"):
            assert full / 2 <= got["params"] <= full / 2 + 4 * 14  # ~1/N plus padding
            assert m["local_shapes"]["l2.weight"] == ((3, 14) if rank == 0 else (2, 14))
    if strategy == "zero1":
        o0 = measured[0][strategy]["after_step"]["optimizer"]
        o1 = measured[1][strategy]["after_step"]["optimizer"]
        assert o0 + o1 == measured[0]["ddp"]["after_step"]["optimizer"]  # a true partition


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_bytes_match_core_exact_model(measured, strategy):
    from dpnb.core import exact_memory as memory

    specs = [memory.ParamSpec(n, s) for n, s in SHAPES.items()]
    model = memory.exact_rank_bytes(specs, 2, strategy, "adamw", gradient_as_bucket_view=True)
    for rank in (0, 1):
        got = measured[rank][strategy]["after_step"]
        rb = model[rank]
        assert (got["params"], got["grads"], got["optimizer"]) == (rb.params, rb.grad_storage, rb.optimizer_state)
        assert got["total"] == rb.tensor_bytes


def test_bucket_records(measured):
    for rank in (0, 1):
        b = measured[rank]["buckets"]
        on = b["on"]
        assert [s["step"] for s in on] == [0, 1, 2]  # record=False added nothing
        assert b["n_after_off"] == 3
        assert b["sampled"] == [10, 15]  # one step in RECORD_EVERY, and the call's last
        assert b["hooks_after"] == 0  # the ready hooks are gone once a call ends
        for s in on[1:]:  # after DDP's first-iteration bucket rebuild
            bk = s["buckets"]
            # grad_accum=2: only the last micro-batch's backward all-reduces
            # (no_sync in the first), each bucket once
            assert sorted(x["index"] for x in bk) == list(range(len(bk)))
            assert {x["micro_batch"] for x in bk} == {1}
            assert len(bk) == 4
            assert sum(x["bytes"] for x in bk) == b["grad_bytes"] == 4 * 4 * (16 * 16 + 16)
            names = [n for x in bk for n in x["params"]]
            assert sorted(names) == sorted(b["names"])
            bw = s["backward"]
            assert bw["start"] < bw["compute_end"] <= bw["returned"]
            for x in bk:
                assert bw["start"] <= x["start"] <= x["end"] <= bw["returned"] + 1e-3
            # overlap: some all-reduce starts while backward still computes
            assert min(x["start"] for x in bk) < bw["compute_end"]
            mods = [iv["module"] for iv in bw["intervals"]]
            assert mods == ["layers.3", "layers.2", "layers.1", "layers.0"]
        # the step records carry the recorded bytes only when recording was on
        assert b["last_records"][0]["bytes"]["grads"] == b["grad_bytes"]
        assert b["last_records"][1]["bytes"] is None


def test_the_allocator_is_read_only_on_the_steps_that_count_bytes(measured):
    for rank in (0, 1):
        b = measured[rank]["bytes_read"]
        s0 = b["first"]
        assert b["resets"] == [s0, s0 + 25, s0 + 29]  # a call's first, every 25th, its last
        assert b["counted_at"] == [s0] * 25 + [s0 + 25] * 4 + [s0 + 29]
