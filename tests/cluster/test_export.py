"""``%dp export``: the notebook session, run as a torchrun job, reaches the notebook's loss.

A 2-rank DDP job (momentum SGD, micro-batch 2 x grad-accum 3) trains 3 steps
in the "notebook" (this process's cluster), with a few cells that cannot go
into a job: an unmarked one, a rank-selected one and a push.  It is exported
(the checkpoint is taken at step 3), then the notebook trains 2 more steps.
The exported ``run.sh`` -- torchrun with 2 processes -- is run with
``--steps 2`` and must print the same per-step losses and final loss.
"""

import os
import re
import subprocess
import sys

import pytest
from helpers.bounded import run_bounded
from helpers.mp import free_port
from helpers.shell import magics_on

import dpnb
from dpnb.errors import DpnbError

#: the exported job's bound: it takes ~10 s; short of the test's own 300 s, so an
#: overrun fails with the job's stacks (helpers.bounded), not pytest-timeout's
JOB_S = 150

SETUP = """
import torch, dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=240, in_dim=8, out_dim=2, seed=1)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
"""


@pytest.fixture(scope="module")
def c():
    c = dpnb.start(2, timeout=10.0)
    yield c
    c.stop()


def test_export_runs_under_torchrun_to_the_notebooks_loss(c, tmp_path):
    job = tmp_path / "job"
    with pytest.raises(DpnbError, match="nothing to export: no model is wrapped"):
        c.export(str(job))
    c.run(SETUP, display=False, setup=True)
    c.run("scratch = 1", display=False)
    c.run("only_here = 2", ranks=[0], display=False)
    c.push({"from_nb": 3})
    c.wrap("net", "ddp", optimizer="sgd", lr=0.05, momentum=0.9)
    c.set_data("ds", seed=3)
    c.train(steps=3, micro_batch=2, grad_accum=3, progress=False)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(DpnbError, match="is a file"):
        c.export(str(tmp_path / "a-file"))

    info = c.export(str(job))
    assert info["step"] == 3
    assert {"train.py", "run.sh", "job.sbatch", "EXPORT.txt"} <= set(os.listdir(job))
    reasons = dict(info["skipped"])
    assert reasons["cell: scratch = 1"].startswith("not marked %%dp --setup")
    assert "rank 0 only (rank-selected)" in reasons["cell: only_here = 2"]
    assert "lives in the notebook" in reasons["%dp push from_nb"]
    assert "only_here = 2" in (job / "EXPORT.txt").read_text()
    script = (job / "train.py").read_text()
    compile(script, "train.py", "exec")
    assert "ds = dpnb.data.SyntheticRegression" in script and "\nscratch = 1\n" not in script
    assert "training.wrap(globals(), 'net', 'ddp'" in script
    for f in ("run.sh", "job.sbatch"):
        assert subprocess.run(["bash", "-n", str(job / f)]).returncode == 0, f
    sbatch = (job / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1" in sbatch and "srun torchrun" in sbatch

    nb = c.train(steps=2, micro_batch=2, grad_accum=3, progress=False)

    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("RANK", None)
    p = run_bounded(["bash", "run.sh", "--steps", "2", "--out", "ck2"], cwd=job, env=env,
                    timeout_s=JOB_S)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "resumed from checkpoint at step 3" in p.stdout, p.stdout
    m = re.search(r"steps 3-4: global batch 12, loss (\S+) (\S+)", p.stdout)
    assert m, p.stdout
    job_losses = [float(x) for x in m.groups()]
    for a, b in zip(job_losses, nb["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (job_losses, nb["losses"])
    final = float(re.search(r"final loss (\S+) at step 4", p.stdout).group(1))
    assert abs(final - nb["loss"]) <= 1e-5 * max(1.0, abs(nb["loss"]))
    assert os.path.isdir(job / "ck2" / "step-00000005")


def test_export_magic_lists_what_it_left_out(c, tmp_path, capsys):
    with magics_on(c) as ip:
        ip.run_line_magic("dp", f"export {tmp_path / 'j2'}")
        out = capsys.readouterr().out
        assert "dpnb: wrote EXPORT.txt, job.sbatch, run.sh, train.py" in out, out
        assert "left out 3" in out and "  - cell: scratch = 1: not marked" in out, out


def test_from_scratch_starts_where_the_notebook_loaded_its_checkpoint(c, tmp_path):
    """The notebook trains 3 steps, saves, trains 2 more, goes back to its save
    (``%dp load``) and trains 2 steps from there.  The exported job run with
    ``--from-scratch`` loads that save, as the notebook did, and replays only
    the 2 steps since: its losses are the notebook's.  (Replaying the 7 steps
    from the fresh model, or the 2 from it, gives other losses.)"""
    c.run(SETUP, display=False, setup=True)
    c.wrap("net", "ddp", optimizer="sgd", lr=0.05, momentum=0.9)
    c.set_data("ds", seed=3)
    c.train(steps=3, micro_batch=2, grad_accum=3, progress=False)
    ck = str(tmp_path / "ck3")
    c.save(ck)
    c.train(steps=2, micro_batch=2, grad_accum=3, progress=False)
    assert c.load(ck)["step"] == 3
    nb = c.train(steps=2, micro_batch=2, grad_accum=3, progress=False)
    assert nb["first_step"] == 3
    job = tmp_path / "job"
    c.export(str(job))
    script = (job / "train.py").read_text()
    assert f"BASE = ({ck!r}, 3)" in script, script
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("RANK", None)
    p = run_bounded(["bash", "run.sh", "--from-scratch", "--out", "ck-fs"], cwd=job, env=env,
                    timeout_s=JOB_S)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"loaded {ck} at step 3, as the notebook did" in p.stdout, p.stdout
    m = re.search(r"steps 3-4: global batch 12, loss (\S+) (\S+)\n", p.stdout)
    assert m, p.stdout
    job_losses = [float(x) for x in m.groups()]
    for a, b in zip(job_losses, nb["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (job_losses, nb["losses"])


# What the end of an exported train.py does (job.run ends with job.finish), in
# one single-rank process: a gloo broadcast whose work thread still holds the
# tensor, DDP and dpnb's state holding the group.  The threads are counted by
# name in the process itself (pt_gloo_runloop, gloo_tcp_loop).
FINISH = """
import torch, torch.distributed as dist
from dpnb.engine.train import job, training
ns = {}
job.init(ns, backend="gloo", timeout_s=30)
ns["net"] = torch.nn.Linear(4, 2)
training.wrap(ns, "net", "ddp", optimizer="sgd", lr=0.1)
dist.broadcast(torch.ones(3), src=0)
before = job.gloo_workers()
job.finish(ns)
print("threads", before, job.gloo_workers(), "model" in ns, "_dpnb" in ns)
"""


def test_job_finish_joins_gloo_threads_before_teardown():
    """A job whose gloo threads outlive ``run()`` can abort at interpreter
    teardown (a work thread's last tensor drop needs the GIL): after
    ``job.finish`` none is left, and dpnb's objects that held the group are gone."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", FINISH], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"threads (\d+) (\d+) (\w+) (\w+)", p.stdout)
    assert m, p.stdout + p.stderr[-2000:]
    assert int(m.group(1)) >= 2, p.stdout  # the count sees a live group's threads
    assert m.groups()[1:] == ("0", "False", "False"), p.stdout + p.stderr[-2000:]
