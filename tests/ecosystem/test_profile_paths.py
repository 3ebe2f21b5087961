"""``--profile`` on every path people bring code by: a torchrun script (``%dp run``),
an Accelerate loop and an FSDP2 model built in cells, and dpnb's own ``%dp train``.

Each profile must find what that code really did on every rank -- its
collectives by kind, the model's forwards -- and leave the cluster whole.
"""

from __future__ import annotations

import pytest

from helpers.ecosystem import ACCELERATE_LOOP, assert_whole, script
from helpers.shell import magics_on


def _ops(c) -> set[str]:
    return {col.op for col in c.last_profile.report.collectives}


def test_a_torchrun_script_profiled_with_dp_run(c, tmp_path, capsys):
    pids = [r.pid for r in c.ranks]
    with magics_on(c) as ip:
        ip.run_line_magic("dp", f"run --profile --profile-dir {tmp_path} "
                                f"{script('ddp_train.py')} --epochs 1 --samples 64")
    out = capsys.readouterr().out
    p = c.last_profile
    assert p.what == "script" and p.failure == "" and "Profiled script on 2 of 2 ranks" in out
    assert "all_reduce" in _ops(c)
    assert all(s.steps == 4 for s in p.report.stats)  # 64 samples / (8 x 2 ranks) forwards
    assert p.wait(30) and (tmp_path / "merged.json").is_file()
    assert_whole(c, pids)


def test_an_accelerate_loop_profiled_in_a_cell(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    c.profile(ACCELERATE_LOOP, display=False, out_dir=str(tmp_path))
    rep = c.last_profile.report
    assert "all_reduce" in _ops(c) and all(s.steps == 4 for s in rep.stats), rep.stats
    assert all(s.comm_s > 0 and s.compute_s > 0 for s in rep.stats)
    # DDP's gradient sync, one bucket a step: Linear(8, 16) and Linear(16, 1), 161 floats
    (grads,) = [o for o in rep.ops if o.op == "all_reduce"]
    assert (grads.nbytes, grads.count) == ((8 * 16 + 16 + 16 + 1) * 4, 4), rep.ops
    assert_whole(c, pids)


def test_fsdp2_built_in_a_cell_shows_its_gathers_and_scatters(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    c.run("""
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
fs = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
fully_shard(fs[0]); fully_shard(fs[2]); fully_shard(fs)
fs_opt = torch.optim.SGD(fs.parameters(), lr=0.05)
""", display=False)
    c.profile("for _ in range(2):\n"
              "    fs(torch.randn(16, 32)).square().mean().backward()\n"
              "    fs_opt.step(); fs_opt.zero_grad()", display=False, out_dir=str(tmp_path))
    ops = _ops(c)
    # gloo runs the reduce-scatter as an all-reduce; the profile names what FSDP asked for
    assert ops == {"all_gather", "reduce_scatter"}, ops
    rows = {(o.op, o.nbytes): o.count for o in c.last_profile.report.ops}
    # each rank's shard of a unit, padded on dim 0 to the 2 ranks: fs[0] 64x32 + 64
    # -> 32x32 + 32 floats; fs[2] 1x64 + 1 -> 1x64 + 1; gathered in forward and again
    # in backward (resharded after forward), 2 steps; the gradients reduce-scattered
    # from the whole padded unit (twice the shard) once a step
    shard0, shard2 = (32 * 32 + 32) * 4, (64 + 1) * 4
    assert rows == {("all_gather", shard0): 4, ("all_gather", shard2): 4,
                    ("reduce_scatter", 2 * shard0): 2, ("reduce_scatter", 2 * shard2): 2}, rows
    assert_whole(c, pids)


def test_dpnb_train_profiled(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    c.run("import dpnb.data\nnet = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), "
          "torch.nn.Linear(32, 2))\nds = dpnb.data.SyntheticRegression(n=256, in_dim=8, out_dim=2)",
          display=False)
    c.wrap("net", "ddp", optimizer="sgd", lr=0.05)
    c.set_data("ds")
    s = c.profiled(lambda: c.train(steps=3, micro_batch=8, progress=False), what="train",
                   out_dir=str(tmp_path))
    assert s["steps"] == 3 and c.last_profile.what == "train"
    assert "all_reduce" in _ops(c)
    with magics_on(c) as ip:  # a whole run is refused before anything starts
        for opts in ("--epochs 1", "--steps 500"):
            with pytest.raises(Exception, match="profile a few steps, not a whole run"):
                ip.run_line_magic("dp", f"train {opts} --micro-batch 8 --profile")
    assert c.call("dpnb.engine.metrics.profile.drop").values == [False, False]
    assert_whole(c, pids)
