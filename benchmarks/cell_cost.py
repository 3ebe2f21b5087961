"""The cost of one small cell, five ways, side by side on one 2-rank cluster.

Issue 58's closing check, as a user would run it: each round runs, in an
order rotated from round to round (so no way always goes first or after the
same one),

* ``pass``: a cell that does nothing (the floor: one request to each rank);
* ``checked``: a 1-float ``dist.all_reduce`` cell, its collective checked
  against the other rank's (the mismatch check, dpnb's default);
* ``unchecked``: the same cell, ``--unchecked`` (the flag rides in the cell's
  own request);
* ``profile``: the same cell, ``%%dp --profile`` (``cluster.profile``: the
  profiler on every rank, the traces home, aligned and analysed; their files
  written after the call returns);
* ``by_hand``: the same cell inside ``torch.profiler.profile`` on every rank,
  each rank exporting its trace to a file (what a user does without dpnb).

Reported: the median time of each way, and the median of the per-round
ratios checked/unchecked and profile/by_hand with their interquartile range
(a ratio of medians follows the machine's drift; per-round ratios do not).

    python benchmarks/cell_cost.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import dpnb

CELL = "t = torch.ones(1)\ndist.all_reduce(t)\n"
BY_HAND = """
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as _p:
    t = torch.ones(1)
    dist.all_reduce(t)
_p.export_chrome_trace(f"{folder}/hand-rank{{rank}}.json")
"""
WAYS = ("pass", "checked", "unchecked", "profile", "by_hand")


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def measure(c, rounds: int, folder: str) -> dict[str, list[float]]:
    """Per way, its time in each round (seconds)."""
    by_hand = BY_HAND.format(folder=folder)
    calls = {
        "pass": lambda: c.run("pass", display=False),
        "checked": lambda: c.run(CELL, display=False),
        "unchecked": lambda: c.run(CELL, display=False, unchecked=True),
        "profile": lambda: c.profile(CELL, display=False, out_dir=folder),
        "by_hand": lambda: c.run(by_hand, display=False),
    }
    for fn in calls.values():  # warm: each way's first call (imports, the profiler's start)
        fn()
    c.last_profile.wait()
    rows: dict[str, list[float]] = {w: [] for w in WAYS}
    for i in range(rounds):
        for w in WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]:
            t0 = time.perf_counter()
            calls[w]()
            rows[w].append(time.perf_counter() - t0)
            if w == "profile":
                # its files are written after the call: wait for them outside every
                # timed call, so the writing does not share the next call's cores
                c.last_profile.wait()
    return rows


def report(rows: dict[str, list[float]]) -> list[str]:
    n = len(rows["pass"])
    out = [f"2 ranks, {n} rounds, ways rotated each round; medians:"]
    out += [f"  {w:<10} {statistics.median(rows[w]) * 1e3:7.2f} ms" for w in WAYS]
    for num, den in (("checked", "unchecked"), ("unchecked", "checked"),
                     ("profile", "by_hand"), ("checked", "pass")):
        lo, med, hi = _quartiles([a / b for a, b in zip(rows[num], rows[den])])
        out.append(f"  {num}/{den}: {med:.3f} (IQR {lo:.3f}-{hi:.3f}, {n} per-round ratios)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="dpnb-cell-cost-")
    with dpnb.start(2) as c:
        rows = measure(c, args.rounds, folder)
    print("\n".join(report(rows)))


if __name__ == "__main__":
    main()
