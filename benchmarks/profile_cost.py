"""What ``%%dp --profile`` costs beside torch's profiler alone, side by side in one run.

One 2-rank cluster, a hand-built DDP (6 x Linear(256, 256), batch 512, 3
steps per cell).  Each round runs, in turn:

* ``plain``: the cell as is;
* ``torch``: the same cell wrapped in ``torch.profiler.profile(record_shapes=True)``
  on every rank, the trace exported to a file (what a user does by hand,
  before collecting the files);
* ``dpnb``: ``cluster.profile(cell)``: the same profiler on every rank, plus
  bringing the traces home, aligning and analysing them; the call returns
  then, and the per-rank and merged traces are written just after (the time
  until they are is reported beside, measured outside the timed cells).

Each round's ratios torch/plain, dpnb/plain and dpnb/torch; the median of
the per-round ratios is reported (it follows the machine's drift far less
than a ratio of medians).  Also the gathered bytes per rank.

    python benchmarks/profile_cost.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import dpnb

SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 256)
"""
STEPS = """
for _ in range(3):
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
BY_HAND = """
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as _p:
{body}
_p.export_chrome_trace(f"{folder}/hand-rank{{rank}}.json")
"""


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="dpnb-profile-bench-")
    by_hand = BY_HAND.format(body="\n".join("    " + ln for ln in STEPS.strip().splitlines()),
                             folder=folder)
    rows: dict[str, list[float]] = {"plain": [], "torch": [], "dpnb": []}
    sizes, written = [], []  # written: from the call until its trace files are all there
    with dpnb.start(2) as c:
        c.run(SETUP, display=False)
        c.run(STEPS, display=False)  # warm: DDP rebuilds its buckets after the first step
        c.profile(STEPS, display=False, out_dir=folder)  # warm: the profiler's first start
        for _ in range(args.rounds):
            rows["plain"].append(_timed(lambda: c.run(STEPS, display=False)))
            rows["torch"].append(_timed(lambda: c.run(by_hand, display=False)))
            t0 = time.perf_counter()
            c.profile(STEPS, display=False, out_dir=folder)
            rows["dpnb"].append(time.perf_counter() - t0)
            # the trace files are written after the call returns: wait for them here,
            # outside every timed cell, so the writing does not share the next round's cores
            c.last_profile.wait()
            written.append(time.perf_counter() - t0)
            sizes.append(max(r.trace_bytes for r in c.last_profile.report.ranks))
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(rows[x], rows[y]))
             for k, (x, y) in {"torch/plain": ("torch", "plain"), "dpnb/plain": ("dpnb", "plain"),
                               "dpnb/torch": ("dpnb", "torch")}.items()}
    print(f"rounds {args.rounds}: plain {med['plain'] * 1e3:.1f} ms, torch.profiler by hand "
          f"{med['torch'] * 1e3:.1f} ms, %%dp --profile {med['dpnb'] * 1e3:.1f} ms")
    print("ratios (median of per-round): " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    spread = {k: (min(a / b for a, b in zip(rows[x], rows[y])),
                  max(a / b for a, b in zip(rows[x], rows[y])))
              for k, (x, y) in {"dpnb/torch": ("dpnb", "torch")}.items()}
    print("dpnb/torch per-round range: " + ", ".join(f"{k} {lo:.2f}-{hi:.2f}"
                                                     for k, (lo, hi) in spread.items()))
    print(f"until the trace files are written: {statistics.median(written) * 1e3:.1f} ms "
          f"(median; the call returns before)")
    print(f"trace per rank: {statistics.median(sizes) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
