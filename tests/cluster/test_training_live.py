"""Training driven from the notebook side on a real 2-engine cluster.

The engine-side numerics (allclose to one big-batch process, exact bytes,
bucket records, checkpoints across strategies) are proven in tests/cluster/test_engine_*.py;
here: the magics and API on a live cluster, progress, Ctrl-C, and that a
fault in a cell leaves training able to continue from the same step.
"""

import os
import signal
import threading
import time

import pytest
from IPython.core.error import UsageError
from helpers.releases import raise_before_all_reduce

import dpnb


SETUP = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=512, in_dim=8, out_dim=1, seed=0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
"""


@pytest.fixture(scope="module", autouse=True)
def _started(ip):
    ip.run_line_magic("dp", "start -n 2 --timeout 6")


def test_wrap_data_train_check_via_magics(ip, capsys):
    c = dpnb.get_cluster(ip)
    with pytest.raises(UsageError, match="no model is wrapped"):
        ip.run_line_magic("dp", "train --steps 1")
    with pytest.raises(UsageError, match="there is no 'net' on ranks 0-1"):
        ip.run_line_magic("dp", "wrap net")
    ip.run_cell_magic("dp", "--setup", SETUP)
    ip.run_line_magic("dp", "wrap net --strategy ddp --lr 0.01")
    ip.run_line_magic("dp", "data ds")
    out = capsys.readouterr().out
    assert "net wrapped with ddp on 2 ranks (321 parameters" in out
    assert "training on ds (512 samples, 256 per rank)" in out

    ip.run_line_magic("dp", "train --steps 6 --micro-batch 8 --grad-accum 2")
    out = capsys.readouterr().out
    assert "step 6/6" in out  # the terminal progress line reached the end
    assert "6 steps, global batch 32 = micro-batch 8 x DP 2 x grad-accum 2" in out
    assert c.training.last_train.summary["global_batch"] == 32

    ip.run_line_magic("dp", "check")
    assert "dpnb: OK, 4 tensors in sync across 2 ranks" in capsys.readouterr().out

    # a perturbed replica is caught and named
    ip.run_cell_magic("dp", "--ranks 1", "with torch.no_grad():\n    net[2].bias.add_(1.0)")
    verdict = ip.run_line_magic("dp", "check")
    assert "MISMATCH" in capsys.readouterr().out
    assert verdict and not verdict["ok"] and "2.bias" in str(verdict["mismatches"])
    # x + 1 - 1 is not x in floating point: repair by copying rank 0's tensor
    ip.run_cell_magic("dp", "", "dist.broadcast(net[2].bias.data, src=0)")
    capsys.readouterr()
    assert ip.run_line_magic("dp", "check") is None  # back in sync: compared again, equal
    assert "dpnb: OK, 4 tensors in sync across 2 ranks" in capsys.readouterr().out
    assert c.check()["mismatches"] == []

    # %dp status says where the peer copies are kept once they are on (DDP: off by
    # default); %dp incidents draws the steps the ranks recorded, no fault among them
    ip.run_line_magic("dp", "status")
    assert "peer copies" not in capsys.readouterr().out
    ip.run_line_magic("dp", "train --steps 1 --micro-batch 8 --peer-copy-every 3")
    capsys.readouterr()
    ip.run_line_magic("dp", "status")
    assert "dpnb: peer copies every 3 steps; copies held (rank->holder): 0->1, 1->0; one host" \
        in capsys.readouterr().out
    ip.run_line_magic("dp", "incidents")
    out = capsys.readouterr().out
    assert "no incidents" in out and "no faults" in out, out
    assert "steps 0..6 recorded between" in out and "(ranks 0,1;" in out, out

    with pytest.raises(UsageError, match="micro_batch x grad_accum = 1000"):
        ip.run_line_magic("dp", "train --steps 1 --micro-batch 1000")
    with pytest.raises(UsageError, match="invalid choice: 'zero9'"):
        ip.run_line_magic("dp", "wrap net --strategy zero9")


def test_fault_in_cell_then_training_continues_from_same_step(ip):
    c = dpnb.get_cluster(ip)
    before = c.train(steps=2, micro_batch=8, progress=False)
    next_step = before["last_step"] + 1
    with pytest.raises(dpnb.DpnbError, match="cannot be sent to the notebook.*pull-model"):
        c.pull("net")  # a module with DDP hooks does not pickle: a clear message
    c.run("w = net[0].weight.detach().clone()", display=False)
    w0 = c.pull("w", rank=0)
    err, _ = raise_before_all_reduce(c)
    assert err.reformed and err.waiting == [0]
    c.run("w = net[0].weight.detach().clone()", display=False)
    w1 = c.pull("w", rank=0)
    assert (w0 == w1).all()  # the model on the engines is intact
    after = c.train(steps=2, micro_batch=8, progress=False)
    assert after["first_step"] == next_step  # same step counter, new group
    assert c.check()["ok"]


def test_ctrl_c_stops_training_at_a_step_boundary(ip):
    c = dpnb.get_cluster(ip)
    c.run("import time\ndef slow_loss(out, target):\n    time.sleep(0.2)\n"
          "    return torch.nn.functional.mse_loss(out, target)", display=False)
    first = c.train(steps=1, micro_batch=8, progress=False)["last_step"] + 1
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    s = c.train(steps=200, micro_batch=8, loss_fn="slow_loss", progress=False)
    timer.join()
    assert time.monotonic() - t0 < 20
    assert s["interrupted"] and 0 < s["steps"] < 200
    assert s["first_step"] == first
    # both ranks stopped after the same step, still in sync, and go on from there
    assert c.check()["ok"]
    nxt = c.train(steps=1, micro_batch=8, progress=False)
    assert nxt["first_step"] == s["last_step"] + 1


def test_save_load_roundtrip_via_magics(ip, tmp_path, capsys):
    c = dpnb.get_cluster(ip)
    ckpt = tmp_path / "ckpt"
    ip.run_line_magic("dp", f"save {ckpt}")
    step = c.training.last_train.summary["last_step"] + 1
    assert f"saved step {step}" in capsys.readouterr().out
    ref = c.train(steps=2, micro_batch=8, progress=False)["losses"]
    ip.run_line_magic("dp", f"load {ckpt}")
    assert f"loaded step {step}" in capsys.readouterr().out
    again = c.train(steps=2, micro_batch=8, progress=False)["losses"]
    assert again == pytest.approx(ref, rel=1e-6, abs=1e-7)
    with pytest.raises(UsageError, match="no checkpoint folder"):
        ip.run_line_magic("dp", f"load {tmp_path / 'nope'}")
    sd = ip.run_line_magic("dp", "pull-model")
    assert set(sd) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert tuple(sd["0.weight"].shape) == (32, 8)


def test_engine_death_then_restart_resume_restores_model_optimizer_step(ip, tmp_path):
    c = dpnb.get_cluster(ip)
    ckpt = str(tmp_path / "resume")
    c.save(ckpt)
    saved_step = c.training.last_train.summary["last_step"] + 1
    ref = c.train(steps=2, micro_batch=8, progress=False)
    side = tmp_path / "side_effect"  # a cell not marked --setup: never replayed
    c.run(f"open({str(side)!r}, 'a').write('x')", display=False)
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c.run("import os\nif rank == 1:\n    os._exit(9)\ndist.barrier()", display=False)
    assert 1 in ei.value.died
    msg = c.restart(resume=ckpt)
    assert "rank 1 replaced" in msg and "rank 0 keeps its state" in msg
    assert f"Resumed from {ckpt} at step {saved_step}" in msg
    assert "cell: import dpnb.data" in msg and "wrap net" in msg  # says what it replayed
    assert side.read_text() == "xx"  # both ranks wrote once; resume replayed only setup
    again = c.train(steps=2, micro_batch=8, progress=False)
    assert again["first_step"] == saved_step
    assert again["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
    assert c.check()["ok"]
