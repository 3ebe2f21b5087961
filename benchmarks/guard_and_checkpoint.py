"""What the mistake guards cost: a checked collective in a cell, and a checkpoint during training.

    python benchmarks/guard_and_checkpoint.py [--json out.json]

* A small ``all_reduce`` (1 float) in a ``%%dp`` cell, on the checked group
  cells use, against the same call on the unchecked group (the one
  ``%dp train`` uses), 300 calls each, alternated 5 times in one cell run.
  ``%dp train`` itself never touches the checked group, so its cost there is
  zero by construction; this shows what a cell pays.
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

CELL = """
import time
t = torch.ones(1)
unchecked = _dpnb.cell_guard.saved
res = {"checked": [], "unchecked": []}
for _ in range(5):
    for name, grp in (("checked", None), ("unchecked", unchecked)):
        dist.barrier(group=grp)
        t0 = time.perf_counter()
        for _ in range(300):
            dist.all_reduce(t, group=grp)
        res[name].append((time.perf_counter() - t0) / 300)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import dpnb
    from suite import SETUP_CELL

    c = dpnb.start(2)
    out: dict = {}
    try:
        c.run(CELL, display=False)
        res = c.pull("res", rank=0)
        chk, unc = statistics.median(res["checked"]), statistics.median(res["unchecked"])
        out["cell_all_reduce_us"] = {"checked": round(chk * 1e6, 1),
                                     "unchecked": round(unc * 1e6, 1), "ratio": round(chk / unc, 2)}
        print("cell all_reduce:", out["cell_all_reduce_us"], flush=True)
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
        out["checkpoint"] = {"model": "mlp", "params": int(c.call("dpnb.engine.training.measure_state_bytes").values[0]["params"] / 4),
                             "train_20_steps_s": round(statistics.median(plain), 3),
                             "per_checkpoint_s": round(statistics.median(per), 3)}
        print("checkpoint:", out["checkpoint"], flush=True)
    finally:
        c.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
