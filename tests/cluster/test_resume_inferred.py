"""``restart --resume`` for the notebook people write: model and data built in
ordinary (unmarked) cells, a rank SIGKILLed mid-training, resume rebuilds from
the cells it finds in the history -- and the next step's loss is the loss a run
without the kill has at that step."""

from __future__ import annotations

import os
import threading
import time

import pytest

import dpnb
from dpnb.session.record import LoadStep
import dpnb.session.resume
from dpnb.errors import DpnbError, RemoteCellError

MODEL = ("import dpnb.data\n"
         "class Net(torch.nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.body = torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.Tanh(),\n"
         "                                        torch.nn.Linear(HIDDEN, HIDDEN))\n"
         "        self.head = torch.nn.Linear(HIDDEN, 1)\n"
         "    def forward(self, x):\n"
         "        return self.head(self.body(x))\n"
         "torch.manual_seed(0)\n"
         "net = Net()\n")


def _kill_mid_training(c, rank: int) -> None:
    """SIGKILL ``rank`` while ``%dp train`` runs (as the OOM killer would)."""
    err: list = []

    def train():
        try:  # far more steps than run before the kill: it ends them
            c.train(steps=10**6, micro_batch=8, progress=False)
        except Exception as e:  # the assertion below says what it was
            err.append(e)

    t = threading.Thread(target=train)
    t.start()
    time.sleep(1.5)
    c.kill_rank(rank)
    t.join(120)
    assert err and isinstance(err[0], RemoteCellError) and rank in err[0].died, err


def _scenario(c, strategy: str, tmp_path) -> None:
    side = tmp_path / "side"
    side.write_text("kept")
    c.run("HIDDEN = 16", display=False)  # read by the model's cell
    c.run(MODEL, display=False)
    c.run("ds = dpnb.data.SyntheticRegression(n=512, in_dim=8, out_dim=1, seed=0)",
          display=False)
    # binds nothing needed: never replayed (both ranks share the file: one removes it)
    c.run(f"import os\ntry:\n    os.remove({str(side)!r})\nexcept FileNotFoundError:\n    pass",
          display=False)
    c.run(f"!rm -f {side}", display=False)
    c.wrap("net", strategy, optimizer="sgd", lr=0.05)
    c.set_data("ds")
    c.train(steps=10, micro_batch=8, progress=False)
    # never given --peer-copy-every: a sharded strategy copies each shard to its
    # holder every 10 steps (the first at step 10); DDP's replicas need no copy
    info = c.call("dpnb.engine.train.peercopy.info").values
    want = (10, 10) if strategy != "ddp" else (0, None)
    assert [(v["every"], v["own_step"]) for v in info] == [want] * c.world_size, info
    ck = str(tmp_path / "ck")
    c.save(ck)
    ref = c.train(steps=1, micro_batch=8, progress=False)["losses"]
    side.write_text("kept")
    pids = [r.pid for r in c.ranks]
    _kill_mid_training(c, c.world_size - 1)
    msg = c.restart(resume=ck)
    assert f"Resumed from {ck} at step 10" in msg, msg
    # the state is that checkpoint's now: a load in the record, where the train
    # calls count from (an export's --from-scratch starts there)
    assert c.setup_log.base() == LoadStep(os.path.abspath(ck), 10)
    assert c.training.train_log == []
    assert "cell: HIDDEN = 16 (binds HIDDEN" in msg and "cell: import dpnb.data" in msg, msg
    assert "cell: ds = dpnb.data.SyntheticRegression" in msg, msg
    if strategy in ("zero2", "zero3"):
        assert "shards the module in place" in msg and "Rebuilt on ranks 0-" in msg, msg
    else:
        assert f"Rebuilt on rank {c.world_size - 1} (they started empty)" in msg, msg
        assert [r.pid for r in c.ranks][:-1] == pids[:-1]  # survivors are the same engines
    assert side.read_text() == "kept"  # neither the os.remove nor the !rm cell ran again
    again = c.train(steps=1, micro_batch=8, progress=False)
    assert again["first_step"] == 10
    assert again["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert c.check()["ok"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_resume_rebuilds_from_the_cells_that_built_the_model(strategy, tmp_path):
    with dpnb.start(2) as c:
        _scenario(c, strategy, tmp_path)


def test_resume_on_three_ranks_after_checkpoint_every(tmp_path):
    with dpnb.start(3) as c:
        c.run("HIDDEN = 12", display=False)
        c.run(MODEL, display=False)
        c.run("ds = dpnb.data.SyntheticRegression(n=600, in_dim=8, out_dim=1, seed=1)",
              display=False)
        c.wrap("net", "zero3", optimizer="sgd", lr=0.05)
        c.set_data("ds")
        c.call("dpnb.engine.train.peercopy.set_every", 0)  # no copy in memory: the disk path
        s = c.train(steps=4, micro_batch=4, progress=False, checkpoint_every=2,
                    checkpoint_dir=str(tmp_path / "auto"))
        assert len(s["checkpoints"]) == 2
        ref = c.train(steps=1, micro_batch=4, progress=False)["losses"]  # step 4, unkilled
        _kill_mid_training(c, 1)
        msg = c.restart(resume="")  # the latest automatic checkpoint: step 4's
        assert f"Resumed from {s['checkpoints'][-1]} at step 4" in msg, msg
        assert "Rebuilt on ranks 0-2" in msg and "cell: HIDDEN = 12" in msg, msg
        again = c.train(steps=1, micro_batch=4, progress=False)
        assert again["first_step"] == 4
        assert again["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
        assert c.check()["ok"]


def test_a_name_no_replayable_cell_binds_is_refused_before_anything_is_replaced():
    with dpnb.start(2) as c:
        c.run("import dpnb.data\nds = dpnb.data.SyntheticRegression(n=64, in_dim=4, out_dim=1)",
              display=False)
        c.run("torch.manual_seed(0)\nnet = torch.nn.Linear(4, 1)", display=False)
        # then rebuilt on each rank by a cell of its own: the last binding is rank-selected
        c.run("net = torch.nn.Linear(4, 1)", ranks=[0], display=False)
        c.run("net = torch.nn.Linear(4, 1)", ranks=[1], display=False)
        c.wrap("net", "ddp")
        c.set_data("ds")
        c.train(steps=1, micro_batch=4, progress=False)
        ck = os.path.join(c.profile_dir, "ck")
        c.save(ck)
        with pytest.raises(RemoteCellError):
            c.run("import os\nif rank == 1:\n    os._exit(3)\ndist.barrier()", display=False)
        pid0 = c.ranks[0].pid
        with pytest.raises(DpnbError) as ei:
            c.restart(resume=ck)
        msg = str(ei.value)
        assert "resume cannot rebuild 'net' (needed by the wrap (wrap net (ddp)))" in msg, msg
        assert "ran on rank 1 only" in msg and "Nothing was replaced" in msg, msg
        assert c.dead == {1: "exit code 3"} and c.ranks[0].pid == pid0  # nothing touched
        lines = dpnb.session.resume.describe(c)  # what %dp setup shows
        assert any(line.startswith("cannot rebuild 'net'") for line in lines), lines


def test_where_names_the_users_line_not_the_library_frame():
    with dpnb.start(2) as c:
        with pytest.raises(RemoteCellError) as ei:
            c.run("import queue\nq = queue.Queue()\nq.get()\n", timeout=1.0, display=False)
        report = ei.value.report
        assert "rank 0 is running Python code at cell line 3, inside queue" in report, report
