"""A mistake's cost while a stranger holds connections to the cluster's ports.

    python benchmarks/shared_host.py --rounds 5

One local 2-rank cluster.  Each round times the same faulty cell (rank 1
raises while rank 0 waits in an all_reduce: report, release, re-formation)
twice, in alternating order: once quiet, once while
``tests/helpers/intruder.py`` holds 8 silent, 8 dribbling and 1 endless
connection to every TCP port the engines listen on (the rendezvous store,
gloo's listeners; the side doors are UNIX sockets a stranger cannot reach).
Prints the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dpnb  # noqa: E402

INTRUDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "helpers", "intruder.py")
FAULT = "if rank == 1: raise ValueError('boom')\nx = torch.ones(1); dist.all_reduce(x)"


def _targets(c) -> list[list]:
    out = []
    for ri in c.ranks:
        for x in psutil.Process(ri.pid).net_connections(kind="tcp"):
            if x.status == psutil.CONN_LISTEN:
                out.append(["127.0.0.1", x.laddr.port])
    return out


def _fault(c) -> float:
    t0 = time.monotonic()
    try:
        c.run(FAULT, display=False)
    except dpnb.RemoteCellError:
        pass
    c.run("x = torch.ones(1); dist.all_reduce(x)", display=False)  # healthy again
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    c = dpnb.start(2, timeout=10)
    quiet, attacked = [], []
    try:
        _fault(c)  # warm-up
        for i in range(a.rounds):
            for kind in (("quiet", "attacked") if i % 2 else ("attacked", "quiet")):
                if kind == "quiet":
                    quiet.append(_fault(c))
                    continue
                plan = {"hold": {"targets": _targets(c), "seconds": 6, "per_target": 8}}
                p = subprocess.Popen([sys.executable, INTRUDER, json.dumps(plan)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                time.sleep(1.5)  # the connections open, the endless lines flowing
                attacked.append(_fault(c))
                out, err = p.communicate(timeout=60)
                if p.returncode:
                    raise SystemExit(f"intruder failed: {err[-500:]}")
                held = json.loads(out.strip().splitlines()[-1])["hold"]
                print(f"round {i}: {sum(len(v) for v in held.values())} connections held",
                      flush=True)
    finally:
        c.stop()
    ratios = [x / q for x, q in zip(attacked, quiet)]
    print("| raise → report → healthy | quiet | under attack | ratio |")
    print("|---|---|---|---|")
    print(f"| 2 ranks, median of {a.rounds} | {statistics.median(quiet):.2f} s | "
          f"{statistics.median(attacked):.2f} s | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
