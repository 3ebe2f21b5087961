"""What a spare engine saves a restart: ``%dp restart`` after a SIGKILL, with and without.

    python benchmarks/spares.py [--n 2] [--rounds 10] [--json out.json]

Two local clusters of ``n`` ranks run side by side, one started with
``--spares 1`` and one without.  Each round SIGKILLs the last rank of each
(the order of the two alternating), waits until its agent has reported the
exit -- as a user's restart follows the error that named the death -- and
times ``restart()`` up to a re-formed group, then one ``all_reduce`` across
it.  Printed: the medians and the median of the per-round ratios (with
spares / without), with their quartiles; the runs' own spread decides how
far a single round can be trusted on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dpnb  # noqa: E402
from suite import med, paired, stats  # noqa: E402

CHECK = "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == world_size"


def _kill_and_restart(c) -> float:
    ri = c.ranks[-1]
    os.kill(ri.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while c.engine_launcher.exit_of(ri, None) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    c.restart()
    took = time.monotonic() - t0
    assert c.run(CHECK, display=False).ok
    return took


def run(n: int, rounds: int) -> dict:
    with_, without = dpnb.start(n, spares=1), dpnb.start(n)
    try:
        a, b = [], []
        for i in range(rounds):
            time.sleep(1.5)  # the spare forked by the last round registers (a fault's pace)
            for c, out in ((with_, a), (without, b)) if i % 2 == 0 else \
                    ((without, b), (with_, a)):
                out.append(_kill_and_restart(c))
        ratios = paired(a, b)
        return {"n": n, "rounds": rounds, "with_spares_s": stats(a), "without_s": stats(b),
                "ratio": stats(ratios), "ratio_median": med(ratios)}
    finally:
        with_.stop()
        without.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = run(a.n, a.rounds)
    w, wo, r = out["with_spares_s"], out["without_s"], out["ratio"]
    print(f"restart after a SIGKILL, {a.n} ranks, {a.rounds} rounds: with a spare "
          f"{w['median']:.3f} s (IQR {w['q1']:.3f}-{w['q3']:.3f}), without "
          f"{wo['median']:.3f} s (IQR {wo['q1']:.3f}-{wo['q3']:.3f}); ratio "
          f"{r['median']:.3f} (IQR {r['q1']:.3f}-{r['q3']:.3f})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
