"""Pauses inside long training loops: the slowest steps beside the median.

A median step time hides a pause that hits one step in a few hundred; a
long call's slowest steps and its mean show it.  On a 2-rank cluster (mlp,
DDP, the training benchmark's model and batch) this runs ``--calls`` calls
of ``--steps`` steps and prints, per call and rank 0's records: the median,
mean, 99th percentile and slowest step, and how many steps took more than
three medians.  Each rank's pauses stall every rank at the next gradient
sync, so on N ranks the slow steps are the union of every rank's.

Then what one full collection costs an engine, side by side in one run:
rounds alternate between the engine's start-up heap left in the collector's
reach (``gc.unfreeze()``) and frozen again (``gc.freeze()``, what dpnb does at
start-up: :func:`dpnb.engine.proc.process.freeze_startup_heap`).  A full
collection comes when enough objects have outlived younger collections, and
whenever code calls ``gc.collect()`` (Accelerate's ``free_memory``, many
evaluation loops, users).

    python benchmarks/long_call.py [--steps 400] [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import suite  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args(argv)
    ctx = suite.Context(smoke=False, rounds=1)
    ctx.start_main()
    try:
        sh, c = ctx.shell, ctx.cluster
        mb = suite._setup(c, "mlp", "ddp", False, shell=sh)
        c.train(steps=5, micro_batch=mb, progress=False)
        print("call | median ms | mean ms | p99 ms | slowest ms | steps > 3 medians")
        for i in range(a.calls):
            c.train(steps=a.steps, micro_batch=mb, progress=False)
            t = sorted(1e3 * r["step_time_s"] for r in c.call(
                "dpnb.engine.train.training.records", last=a.steps).values[0])
            med = statistics.median(t)
            print(f"{i} | {med:.1f} | {statistics.fmean(t):.1f} | {t[int(0.99 * (len(t) - 1))]:.1f} | "
                  f"{t[-1]:.1f} | {sum(x > 3 * med for x in t)}")
        full_collection(c, a.calls)
    finally:
        ctx.stop_main()
    return 0


FULL = """
import gc, time
gc.{how}()
t0 = time.perf_counter()
gc.collect()
full_ms = 1e3 * (time.perf_counter() - t0)
"""


def full_collection(c, rounds: int) -> None:
    print("round | heap | full gc.collect() ms, rank 0 / rank 1")
    for i in range(rounds):
        for how in ("unfreeze", "freeze"):
            c.run(FULL.format(how=how), display=False)
            ms = c.pull("full_ms")
            print(f"{i} | {'frozen' if how == 'freeze' else 'in reach'} | "
                  + " / ".join(f"{x:.1f}" for x in ms))


if __name__ == "__main__":
    sys.exit(main())
