"""What recovery from memory costs and saves: peer copies every K steps, and a death resumed.

    python benchmarks/peercopy.py [--rounds 3] [--steps 30] [--json out.json]

On one 2-rank cluster per model (mlp, tinylm of benchmarks/models.py), zero2:

* step time with the peer copy off and at K = 1, 10, 50, each both ways --
  sent from the side thread (the default) and waited for by the step
  ("Ksync", the synchronous copy) -- alternated in each round (the order
  rotates), as the wall time of a ``train`` call over its steps; reported
  as ratios to "off" (median over rounds), and the milliseconds each copy
  held the step up (rank 0: the snapshot, and with "sync" the exchange);
* the copy's CPU memory per rank (own snapshot + the neighbour's copy);
* a death: rank 1 SIGKILLed mid-training, then ``restart(resume=True)`` from
  the peer copies at the default K against the same from the disk checkpoint
  (``--checkpoint-every`` at the same K, copies off): seconds from the kill to
  the first step trained again, and steps lost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

KS = (0, 1, 10, 50)
# (K, the step waits for the copy): the side thread's copy and the synchronous one, alternated
CONFIGS = [(0, False)] + [(k, w) for k in KS[1:] for w in (False, True)]
SET = "dpnb.engine.train.peercopy.set_every"
INFO = "dpnb.engine.train.peercopy.info"


def _label(k: int, wait: bool) -> str:
    return f"{k}sync" if wait else str(k)


def step_cost(c, mb: int, rounds: int, steps: int) -> dict:
    """Seconds per step in each configuration (K 0: off), alternated, rotating the order."""
    got: dict[str, list] = {_label(*cf): [] for cf in CONFIGS}
    path: dict[str, list] = {_label(*cf): [] for cf in CONFIGS if cf[0]}  # ms the step waited
    ratios: dict[str, list] = {_label(*cf): [] for cf in CONFIGS if cf[0]}
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        now = {}
        for k, wait in order:
            c.call(SET, k, wait=wait)
            t0 = time.perf_counter()
            c.train(steps=steps, micro_batch=mb, progress=False)
            now[_label(k, wait)] = (time.perf_counter() - t0) / steps
            got[_label(k, wait)].append(now[_label(k, wait)])
            cost = c.call(INFO, ranks=[0]).values[0]["cost"]
            if k and cost[0]:
                path[_label(k, wait)].append(cost[1] / cost[0] * 1e3)
        for k in ratios:
            ratios[k].append(now[k] / now["0"])
    return {"ms_per_step": {k: round(statistics.median(v) * 1e3, 2) for k, v in got.items()},
            "ratio_to_off": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
            "ms_on_path_per_copy": {k: round(statistics.median(v), 2) for k, v in path.items() if v}}


def _kill_and_resume(c, mb: int, **train_kw) -> dict:
    """Kill rank 1 mid-training; resume without a folder; train one step."""
    err: list = []

    def train():
        try:
            c.train(steps=10**6, micro_batch=mb, progress=False, **train_kw)
        except Exception as e:  # the death: expected
            err.append(e)

    t = threading.Thread(target=train)
    t.start()
    time.sleep(3.0)
    c.kill_rank(1)
    t_kill = time.perf_counter()
    t.join(300)
    reached = c.call("dpnb.engine.train.rebuild.replica_info", ranks=[0]).values[0]["step"]
    msg = c.restart(resume=True)
    s = c.train(steps=1, micro_batch=mb, progress=False)
    return {"death_to_training_s": round(time.perf_counter() - t_kill, 2),
            "steps_lost": reached - s["first_step"], "from": "memory" if "copy of rank" in msg else "disk",
            "message": msg[msg.find("rank 1 replaced"):][:160] if "copy" in msg else msg[-160:]}


def one_model(name: str, rounds: int, steps: int) -> dict:
    # lazy: the benchmark starts the cluster only when run
    import dpnb
    from suite import SETUP_CELL

    out: dict = {"model": name}
    with dpnb.start(2) as c:
        c.run(SETUP_CELL.format(here=HERE, name=name, tiny=False), display=False, setup=True)
        c.wrap("net", "zero2")
        c.set_data("ds")
        mb = int(c.pull("mb", rank=0))
        c.train(steps=3, micro_batch=mb, progress=False)  # warm-up
        out.update(step_cost(c, mb, rounds, steps))
        c.call(SET, 10)
        c.train(steps=12, micro_batch=mb, progress=False)
        info = c.call("dpnb.engine.train.peercopy.info").values
        out["copy_mb_per_rank"] = [round(i["bytes"] / 2**20, 2) for i in info]
        out["memory_resume"] = _kill_and_resume(c, mb)
        c.call(SET, 0)
        d = tempfile.mkdtemp(prefix="dpnb-peer-")
        kw = {"checkpoint_every": 10, "checkpoint_dir": os.path.join(d, "auto")}
        c.train(steps=12, micro_batch=mb, progress=False, **kw)
        out["disk_resume"] = _kill_and_resume(c, mb, **kw)
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--models", default="mlp,tinylm")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = [one_model(m, a.rounds, a.steps) for m in a.models.split(",")]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
