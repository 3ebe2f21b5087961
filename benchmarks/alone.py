"""dpnb alone at N ranks on this machine: start, a `pass` cell, an error report,
a status query, stop, and what is left; each engine's unique memory and file
descriptors (rank 0, another rank, the controller) while the cluster is up.

    python benchmarks/alone.py -n 128 [--cells 5]

Unique memory: ``Private_Clean + Private_Dirty`` of ``/proc/PID/smaps_rollup``
(pages no other process shares: what one more engine costs); RSS counts the
zygote's pages every forked engine still shares.
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil

RAISE = "raise ValueError('bench')"


def private_mib(pid: int) -> float:
    kb = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                kb += int(line.split()[1])
    return kb / 1024


def _med(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} ms (min {min(xs) * 1e3:.0f}, max {max(xs) * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--cells", type=int, default=5)
    a = ap.parse_args()
    import dpnb

    t0 = time.perf_counter()
    c = dpnb.start(a.n, threads=1)
    print(f"N={a.n} start {time.perf_counter() - t0:.1f} s", flush=True)
    pids = [r.pid for r in c.ranks]
    try:
        for name, code in (("pass cell", "pass"), ("error report", RAISE)):
            ts = []
            for i in range(a.cells + 1):
                t = time.perf_counter()
                try:
                    c.run(code, display=False)
                except dpnb.RemoteCellError as e:
                    assert e.summary.startswith(f"ranks 0-{a.n - 1} raised ValueError"), e.summary
                if i:  # the first call of each kind is a warm-up
                    ts.append(time.perf_counter() - t)
            print(f"{name}: {_med(ts)}", flush=True)
        ts = []
        for i in range(a.cells):
            t = time.perf_counter()
            c.status()
            ts.append(time.perf_counter() - t)
        print(f"status (first asks, the rest answered from the last answers): "
              f"first {ts[0] * 1e3:.0f} ms, then {_med(ts[1:])}", flush=True)
        uniq = [private_mib(p) for p in pids]
        rss = [psutil.Process(p).memory_info().rss / 2**20 for p in pids]
        print(f"engine unique memory: median {statistics.median(uniq):.0f} MiB (min {min(uniq):.0f}, "
              f"max {max(uniq):.0f}); RSS median {statistics.median(rss):.0f} MiB", flush=True)
        ctl = getattr(getattr(c._ipp, "controller", None), "pid", None)
        fds = {"rank 0": psutil.Process(pids[0]).num_fds(),
               f"rank {a.n - 1}": psutil.Process(pids[-1]).num_fds()}
        if ctl:
            p = psutil.Process(ctl)
            fds["controller (+ its schedulers)"] = p.num_fds() + sum(
                ch.num_fds() for ch in p.children(recursive=True))
        print("open fds: " + ", ".join(f"{k} {v}" for k, v in fds.items()), flush=True)
    finally:
        owned = c._owned_pids()
        t = time.perf_counter()
        c.stop()
        print(f"stop {time.perf_counter() - t:.2f} s", flush=True)
    left = [p for p in owned + pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    print(f"processes left after stop: {len(left)} {left[:5]}", flush=True)


if __name__ == "__main__":
    main()
