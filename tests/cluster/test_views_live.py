"""The views against a real 2-rank gloo cluster: gradsync, memory (exact), comm bench, ring.

One cluster for the module (~10-20 s to start); every test leaves it usable.
"""

import pytest

import dpnb
from dpnb.core import ddp_bucket_caps, ddp_buckets
from dpnb.widgets import batch, comm, dashboard, gradsync, memory, ring, stragglers


SETUP = """
import torch.nn as nn, dpnb.data
ds = dpnb.data.SyntheticRegression(256, 16, 4)
odd = dpnb.data.SyntheticRegression(64, 5, 3)

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

def oddnet():
    torch.manual_seed(0)  # dim-0 sizes 7 and 3 do not split evenly over 2 ranks: FSDP pads
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
"""


@pytest.fixture(scope="module")
def cluster():
    c = dpnb.start(2, timeout=6)
    try:
        c.run(SETUP, display=False)
        yield c
    finally:
        c.stop()


def train(c, model_expr, strategy, data="ds", steps=2, **wrap_kw):
    c.run(f"net = {model_expr}", display=False)
    c.call("dpnb.engine.train.training.wrap", "net", strategy, **wrap_kw)
    c.call("dpnb.engine.train.training.set_data", data)
    gradsync.watch(c)
    return c.call("dpnb.engine.train.training.train", steps=steps, micro_batch=8).values


def test_live_gradsync_ddp(cluster):
    train(cluster, "mlp()", "ddp", steps=3, bucket_cap_mb=0.01)
    recs = gradsync.fetch(cluster, last=2)
    d = gradsync.data(recs, cap_mb=1.0)
    assert d.strategy == "ddp" and d.world_size == 2 and len(d.ranks) == 2
    n_buckets = len(d.buckets)
    assert n_buckets >= 2
    for r in d.ranks:
        assert len(r.lane("all_reduce")) == n_buckets  # one measured all-reduce per bucket
        assert len(r.lane("backward")) == 3  # one segment per Linear, in ready order
        assert r.optimizer_timed and len(r.lane("forward")) == 1
        assert r.comm_s > 0 and r.exposed_s >= 0
    # the model rebuilds DDP's buckets from the measured ready order exactly
    rec = [x for x in recs if x["rank"] == 0 and x["step"] == d.step][0]
    names = rec["param_order"]
    first, cap = ddp_bucket_caps(0.01)
    ref = ddp_buckets([rec["param_bytes"][n] for n in names], cap, first, order=[5, 4, 3, 2, 1, 0])
    assert [b.bytes for b in d.buckets] == [b.nbytes for b in ref] == list(d.predicted.bucket_bytes)
    assert d.comparison[0].endswith("(same sizes)")
    assert any(c.startswith("exposed communication: measured") for c in d.comparison)
    fig = gradsync.figure(d)
    assert len(gradsync.C.broken_barh_segments(fig.axes[0])) >= 8
    box = gradsync.view(cluster, last=2)
    assert box.data.step == d.step and box.image.value[:4] == b"\x89PNG"


def test_live_gradsync_fsdp_events(cluster):
    train(cluster, "mlp()", "zero3", steps=2)
    d = gradsync.data(gradsync.fetch(cluster, last=1))
    for r in d.ranks:
        # 3 units (2 Linear blocks with params, root with the last Linear): all-gathered in forward and
        # again in backward (zero3), gradients reduce-scattered once each
        assert len(r.lane("reduce_scatter")) == 3
        assert len(r.lane("all_gather")) == 6
    assert {c[2] for c in d.collectives} == {"forward", "backward"}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_live_memory_measured_equals_exact(cluster, strategy):
    train(cluster, "oddnet()", strategy, data="odd", steps=1)
    lm = memory.fetch(cluster)
    assert lm.strategy == strategy and lm.phase == "after_step" and lm.world_size == 2
    for r in lm.ranks:
        assert r.diff == {"params": 0, "grads": 0, "optimizer": 0, "total": 0}, (strategy, r)
    if strategy == "zero3":
        # padded shards: 7 rows → 4 + 3 (padded to 4), 3 rows → 2 + 1 (padded to 2)
        assert lm.ranks[0].measured["params"] == lm.ranks[1].measured["params"] == (4 * 5 + 4 + 2 * 7 + 2) * 4
        box = memory.view(cluster)
        assert box.data.live.agrees and "byte for byte" in box.readout.value


def test_live_comm_bench(cluster):
    b = comm.bench(cluster, sizes=[1_000, 100_000, 1_000_000], iters=2)
    assert b.world_size == 2 and b.backend == "gloo" and len(b.times_s) == 3
    assert b.sizes == (1_000, 100_000, 1_000_000) and all(t > 0 for t in b.times_s)
    d = comm.data("gloo-loopback", 2, ("all_reduce",), bench=b)
    fig = comm.figure(d)
    meas = [ln for ln in fig.axes[0].lines if "measured" in ln.get_label()][0]
    assert list(meas.get_ydata()) == pytest.approx([t * 1e3 for t in b.times_s])
    rs = comm.bench(cluster, sizes=[4_000, 40_000], kind="reduce_scatter", iters=1)
    assert rs.kind == "reduce_scatter" and len(rs.busbw) == 2


def test_live_ring_equals_allreduce(cluster):
    lv = ring.run_live(cluster, numel=8)
    assert lv.world_size == 2 and lv.equal and lv.max_abs_diff == 0
    # rank r's reduce-scatter output is chunk r of the all-reduce result
    assert lv.shards[0] + lv.shards[1] == lv.allreduce[0] == lv.gathered[1]
    box = ring.view(cluster)
    assert box.data.live.equal and "== all_reduce" in box.readout.value


def test_live_straggler_batch_dashboard(cluster):
    # two steps first: DDP rebuilds its buckets in the second step's forward with a broadcast,
    # which would make rank 0 wait for the sleeping rank there too
    train(cluster, "mlp()", "ddp", steps=2)
    assert stragglers.inject(cluster, 1, 40) == [0.0, 0.04]
    try:
        cluster.call("dpnb.engine.train.training.train", steps=2, micro_batch=8)
    finally:
        stragglers.clear(cluster)
    recs, delays = stragglers.fetch(cluster)
    d = stragglers.data(recs[-2:], delays_s=delays)
    assert delays == [0.0, 0.0]
    assert all(r.slowest == 1 and r.compute_s[1] - r.compute_s[0] > 0.03 for r in d.steps)
    live = batch.live_settings(cluster)
    assert live["dp"] == 2 and live["micro_batch"] == 8 and live["grad_accum"] == 1
    status, summ = dashboard.collect(cluster)
    dd = dashboard.data(status, summ)
    assert len(dd.status) == 2 and dd.history and dd.strategy == "ddp"


def test_the_step_views_read_after_each_train_call_convert_only_the_last_step(cluster):
    """After every ``%dp train`` the notebook reads each rank's last step for
    JupyterLab's panels (``engine/metrics/views.step_views``).  It made every
    recorded step a dict first, so each call cost more as the steps piled up
    (115 ms after 2,400 steps, benchmarks/storm.py's throughput halving over 5
    calm minutes); only the step shown is converted now."""
    train(cluster, "mlp()", "ddp", steps=150)
    cluster.run("from dpnb.engine.train.train_state import StepRecord\n"
                "from dpnb.engine.metrics.views import step_views, viewed_state\n"
                "_made = []\n_as_dict = StepRecord.as_dict\n"
                "StepRecord.as_dict = lambda self: _made.append(self.step) or _as_dict(self)\n"
                "try:\n    _views = step_views(globals())\nfinally:\n    StepRecord.as_dict = _as_dict\n"
                "_n = len(viewed_state(globals()).records)", display=False)
    made, views, n = cluster.pull("_made"), cluster.pull("_views"), cluster.pull("_n")
    for r in range(2):
        assert n[r] >= 150 and views[r]["gradsync"], (n, views)
        assert made[r] == [views[r]["gradsync"][0]["step"]], made[r][:5]
