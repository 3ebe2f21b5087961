"""A DDP ``%dp train`` long enough to fault in the middle of, run in a thread.

The multi-host fault tests (a frozen rank, a cut link) build the same small
model, wrap it in DDP, and start a training call whose loss sleeps 20 ms a
step, so the call is still running when the fault lands; the thread records
the error the call raised and when it returned.
"""

from __future__ import annotations

import threading
import time

from dpnb.errors import RemoteCellError

SETUP = ("import time as _t, dpnb.data\ntorch.manual_seed(0)\nmine = rank\n"
         "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), "
         "torch.nn.Linear(16, 1))\n"
         "ds = dpnb.data.SyntheticRegression(n=4096, in_dim=8, out_dim=1, seed=0)\n"
         "def slow_loss(out, y):\n    _t.sleep(0.02)\n"
         "    return torch.nn.functional.mse_loss(out, y)\n")


def wrapped(c) -> None:
    """The model built, DDP-wrapped with its data, and three steps trained."""
    c.run(SETUP, display=False, setup=True)
    c.wrap("net", "ddp", optimizer="adamw", lr=0.01)
    c.set_data("ds")
    c.train(steps=3, micro_batch=8, progress=False)


def training(c, steps: int) -> tuple[threading.Thread, dict]:
    """A slow training call in a thread, running (checked) 1.5 s later: the
    thread and its outcome (``error``: the RemoteCellError; ``returned``: when)."""
    out: dict = {}

    def train():
        try:
            c.train(steps=steps, micro_batch=8, loss_fn="slow_loss", progress=False)
        except RemoteCellError as e:
            out["error"] = e
        out["returned"] = time.monotonic()

    t = threading.Thread(target=train)
    t.start()
    time.sleep(1.5)
    assert t.is_alive(), out
    return t, out
