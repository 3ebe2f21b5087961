"""How long a mistake costs: from a faulty cell to its report, and to a healthy cluster.

    python benchmarks/release.py [--n 2] [--repeat 3] [--timeout 30] [--json out.json]

Each fault runs ``repeat`` times on a local gloo cluster with the given group
timeout (default 30 s, dpnb's default): the cell's wall time until the error
report is back, whether an engine died, and the time until a checking
all_reduce succeeds again (a ``%dp restart`` included where an engine died).
Run it against an older checkout (``PYTHONPATH=that/checkout``) for the
"before" column; RESULTS.md has both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

FAULTS = {
    "raise before all_reduce": ("t = torch.ones(1)\nif rank == 1:\n    raise ValueError('x')\n"
                                "dist.all_reduce(t)", None),
    "shape mismatch": ("t = torch.ones(4 + rank)\ndist.all_reduce(t)", None),
    "mismatched ops": ("t = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n"
                       "    dist.broadcast(t, src=0)", 10.0),
    "one-sided all_reduce, --timeout 3": ("t = torch.ones(4)\nif rank == 1:\n"
                                          "    dist.all_reduce(t)", 3.0),
    # no cell timeout: rank 0 finished, so rank 1's collective can never complete
    "one-sided all_reduce": ("t = torch.ones(4)\nif rank == 1:\n    dist.all_reduce(t)", None),
    "recv whose sender finished": ("t = torch.ones(4)\nif rank == 1:\n    dist.recv(t, src=0)",
                                   None),
    # the repeated call runs unchecked; the last, smaller one is checked on rank 1 only
    "uneven last batch in a loop": ("for i in range(6):\n    t = torch.ones(3 if (rank == 1 and "
                                    "i == 5) else 4)\n    dist.all_reduce(t)", None),
}


def _one(c, code: str, timeout) -> dict:
    import dpnb

    t0 = time.monotonic()
    died = False
    try:
        c.run(code, display=False, timeout=timeout)
    except dpnb.RemoteCellError as e:
        died = bool(e.died)
    report_s = time.monotonic() - t0
    if died or c.dead:
        c.restart()
    for _ in range(3):
        try:
            if c.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == world_size",
                     display=False).ok:
                break
        except dpnb.DpnbError:
            c.restart()
    return {"report_s": report_s, "healthy_s": time.monotonic() - t0, "died": died}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import dpnb

    c = dpnb.start(a.n, timeout=a.timeout)
    out = {}
    try:
        for name, (code, cell_timeout) in FAULTS.items():
            runs = [_one(c, code, cell_timeout) for _ in range(a.repeat)]
            out[name] = {"report_s": round(statistics.median(r["report_s"] for r in runs), 2),
                         "healthy_s": round(statistics.median(r["healthy_s"] for r in runs), 2),
                         "engine_died": sum(r["died"] for r in runs)}
            print(f"{name}: {out[name]}", flush=True)
    finally:
        c.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "group_timeout_s": a.timeout, "faults": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
