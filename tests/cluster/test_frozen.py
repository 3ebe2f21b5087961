"""A frozen rank -- its engine stopped with SIGSTOP, as a stuck kernel, a swapped-out
process or a debugger left attached would be -- is named, its peers are released
long before the group timeout, and training goes on once it is continued.

The cluster's group timeout is 120 s here, so only the release (not a timeout)
can end the call within the bounds asserted.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import dpnb
from dpnb.errors import RemoteCellError

GROUP_TIMEOUT = 120.0

MODEL = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
g = torch.Generator().manual_seed(1)
ds = torch.utils.data.TensorDataset(torch.randn(4096, 16, generator=g), torch.randn(4096, 1, generator=g))
import time as _t
def slow_loss(out, target):
    _t.sleep(0.02)  # a step long enough to be frozen inside
    return torch.nn.functional.mse_loss(out, target)
"""

STEP = "from dpnb.engine.train.training import train_state\n_step = train_state(globals()).step"


@pytest.fixture(scope="module")
def c():
    c = dpnb.start(2, timeout=GROUP_TIMEOUT)
    c.run(MODEL, display=False)
    c.wrap("net", "ddp", lr=1e-2)
    c.set_data("ds")
    yield c
    for r in c.ranks:  # never leave a stopped engine behind a failed assert
        try:
            os.kill(r.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    c.stop()


def _steps(c) -> list[int]:
    c.run(STEP, display=False)
    return list(c.pull("_step"))


def test_a_rank_frozen_during_train_is_named_released_and_training_continues(c):
    before = _steps(c)
    out: dict = {}

    def train():
        try:
            out["result"] = c.train(steps=400, micro_batch=4, loss_fn="slow_loss", progress=False)
        except RemoteCellError as e:
            out["error"] = e
        out["returned"] = time.monotonic()

    t = threading.Thread(target=train)
    t.start()
    time.sleep(3.0)  # well into the run
    assert t.is_alive(), out
    frozen_at = time.monotonic()
    os.kill(c.ranks[1].pid, signal.SIGSTOP)
    try:
        t.join(30)  # twice the bound asserted below; the group timeout is 120 s
        assert not t.is_alive(), "train still waiting 30 s after rank 1 was frozen"
        took = out["returned"] - frozen_at
        err = out.get("error")
        assert err is not None, out
        text = str(err) + "\n" + err.report if hasattr(err, "report") else str(err)
        # named as frozen (not dead, not "still running"), within the bound, not the group timeout
        assert "rank 1 is frozen" in text and "stopped" in text, text
        assert f"PID {c.ranks[1].pid}" in text, text
        assert took < 15.0, f"released after {took:.1f} s"
        assert 1 in c.busy and not c.dead
    finally:
        os.kill(c.ranks[1].pid, signal.SIGCONT)
    # continued: its call fails at once, the next call re-forms the group, state kept
    deadline = time.monotonic() + 30
    while c.busy and time.monotonic() < deadline:
        c.status()
        time.sleep(0.2)
    assert not c.busy, c.busy
    mid = _steps(c)
    assert mid[0] > before[0] + 10, (before, mid)  # it trained before the freeze
    assert abs(mid[0] - mid[1]) <= 1, f"the ranks' step counters drifted apart: {mid}"
    res = c.train(steps=5, micro_batch=4, progress=False)
    after = _steps(c)
    assert res.steps == 5 and after[0] == after[1], after
    assert after[0] - max(mid) <= 5 and after[0] - min(mid) >= 5 - 1, (mid, after)
    assert c.check()["ok"]  # the replicas agree: no step half-applied on one rank


def test_restart_replaces_a_frozen_rank_at_once(c):
    """The user's other word: ``%dp restart`` instead of ``kill -CONT``.  A frozen
    rank can neither finish its call nor answer an interrupt, so the restart
    kills and replaces it straight away (not after waiting out interrupts and
    the group's formation time); the other rank keeps its state."""
    c.run("kept = 41", display=False)
    pid = c.ranks[1].pid
    with pytest.raises(RemoteCellError) as e:
        def freeze():
            time.sleep(1.0)
            os.kill(pid, signal.SIGSTOP)

        threading.Thread(target=freeze).start()
        c.run("t = torch.ones(1)\nfor _ in range(600):\n    dist.all_reduce(t)\n    _t.sleep(0.02)",
              display=False)
    assert "rank 1 is frozen" in str(e.value) + getattr(e.value, "report", "")
    t0 = time.monotonic()
    try:
        msg = c.restart()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the restart, as it should be
    took = time.monotonic() - t0
    assert "rank 1 replaced" in msg and "rank 0 keeps" in msg, msg
    assert took < 20.0, f"restart took {took:.1f} s"  # the form timeout + 10 s is 130 s here
    assert c.pull("kept", rank=0) == 41
    c.run("t = torch.ones(1)\ndist.all_reduce(t)\nsum_ = t.item()", display=False)
    assert list(c.pull("sum_")) == [2.0, 2.0]


LEFT_BEHIND = """
import signal, socket, time
if rank == 0:
    raise ValueError("boom")
# as a C call that ignores SIGINT (gloo's): the interrupt after the release does nothing
old = signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    time.sleep(1.0)  # the release comes meanwhile: nothing of this rank's is shut yet
    s = socket.create_connection(("127.0.0.1", port))  # opened after its release
    s.recv(1)  # rank 0 never writes: held until something shuts the connection
finally:
    signal.signal(signal.SIGINT, old)
"""


def test_a_rank_left_behind_by_its_release_is_freed_at_the_next_cell(c):
    """A rank that connected after its group's release (as a group formed in the
    moment between would) stays in its call when the notebook stops waiting; the
    next cell releases it once more instead of refusing, "still running"."""
    c.run("import socket\n_l = socket.socket()\n_l.bind(('127.0.0.1', 0))\n_l.listen()\n"
          "port = _l.getsockname()[1]", ranks=[0], display=False)
    c.push({"port": c.pull("port", rank=0)}, ranks=[1])
    with pytest.raises(RemoteCellError):
        c.run(LEFT_BEHIND, display=False)
    assert 1 in c.busy and not c.group_ok  # the notebook stopped waiting for it
    t0 = time.monotonic()
    c.run("t = torch.ones(1)\ndist.all_reduce(t)\nsum_ = t.item()", display=False)
    assert time.monotonic() - t0 < 10.0  # released at once, not the group timeout (120 s)
    assert list(c.pull("sum_")) == [2.0, 2.0] and not c.busy
