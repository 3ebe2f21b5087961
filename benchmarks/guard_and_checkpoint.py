"""What the mistake guards cost: a checked collective in a cell, and a checkpoint during training.

    python benchmarks/guard_and_checkpoint.py [--json out.json] [--guard-only]

* Collectives in ``%%dp`` cells are checked across ranks before they run
  (:mod:`dpnb.engine.cell.cellguard`), each call's site (file, line) recorded and
  compared with the call; ``%%dp --unchecked`` cells are not.  The
  same cell runs both ways, alternated 8 times, three patterns:
  ``back to back`` -- 1000 calls of a 1-float ``all_reduce`` in a loop (the
  agreed period lets repeats skip the check); ``alternating`` -- 1000 calls
  cycling through three different shapes (checked until the period is
  agreed); ``isolated`` -- 100 single calls, each after a barrier and a 2 ms
  pause on every rank (every call checked: nothing repeats the call before
  it).  ``%dp train`` never checks, so its cost there is zero by construction.
* ``%dp train --checkpoint-every 5 DIR`` against the same steps without,
  alternated: the cost per checkpoint (MLP of benchmarks/models.py, ddp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PATTERNS = {
    "back to back": """
import time
t = torch.ones(1)
dist.barrier()
t0 = time.perf_counter()
for _ in range(1000):
    dist.all_reduce(t)
took = (time.perf_counter() - t0) / 1000
""",
    "alternating": """
import time
ts = [torch.ones(1), torch.ones(2), torch.ones(3)]
dist.barrier()
t0 = time.perf_counter()
for i in range(1000):
    dist.all_reduce(ts[i % 3])
took = (time.perf_counter() - t0) / 1000
""",
    "isolated": """
import time
t, took = torch.ones(1), 0.0
for i in range(100):
    dist.barrier()
    time.sleep(0.002)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    took += time.perf_counter() - t0
    t = torch.ones(1 + i % 2)  # never the call before it: always checked
took /= 100
""",
}


def guard_cost(c) -> dict:
    """Per-call seconds of the same cell checked and ``--unchecked``, alternated."""
    out = {}
    for name, cell in PATTERNS.items():
        chk, unc, ratios = [], [], []
        for i in range(8):
            order = (False, True) if i % 2 else (True, False)
            got = {}
            for checked in order:
                c.run(cell, display=False, unchecked=not checked)
                got[checked] = max(c.pull("took"))
            chk.append(got[True])
            unc.append(got[False])
            ratios.append(got[True] / got[False])
        out[name] = {"checked_us": round(statistics.median(chk) * 1e6, 1),
                     "unchecked_us": round(statistics.median(unc) * 1e6, 1),
                     "ratio": round(statistics.median(ratios), 2)}
        print(f"cell all_reduce, {name}:", out[name], flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--guard-only", action="store_true", help="skip the checkpoint part")
    a = p.parse_args(argv)
    import dpnb

    c = dpnb.start(2)
    out: dict = {}
    try:
        out["cell_all_reduce"] = guard_cost(c)
        if not a.guard_only:
            out["checkpoint"] = checkpoint_cost(c)
    finally:
        c.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def checkpoint_cost(c) -> dict:
    """Seconds per checkpoint of ``%dp train --checkpoint-every 5`` against the same steps without."""
    from suite import SETUP_CELL

    c.run(SETUP_CELL.format(here=HERE, name="mlp", tiny=False), display=False)
    c.wrap("net", "ddp")
    c.set_data("ds")
    mb = int(c.pull("mb", rank=0))
    d = tempfile.mkdtemp(prefix="dpnb-ck-")
    c.train(steps=5, micro_batch=mb, progress=False)
    plain, ck = [], []
    for i in range(5):
        t0 = time.perf_counter()
        c.train(steps=20, micro_batch=mb, progress=False)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s = c.train(steps=20, micro_batch=mb, progress=False, checkpoint_every=5,
                    checkpoint_dir=os.path.join(d, "auto"))
        ck.append((time.perf_counter() - t0, len(s["checkpoints"])))
    per = [(t - p_) / n for (t, n), p_ in zip(ck, plain)]
    state = c.call("dpnb.engine.train.training.measure_state_bytes").values[0]
    res = {"model": "mlp", "params": int(state["params"] / 4),
           "train_20_steps_s": round(statistics.median(plain), 3),
           "per_checkpoint_s": round(statistics.median(per), 3)}
    print("checkpoint:", res, flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
