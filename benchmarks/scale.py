"""dpnb against raw ipyparallel at N = 2, 8, 16, 32 local CPU engines (one torch thread each).

For each N both sides are up at once, each with N engines of its own:

* raw: ``ipyparallel.Cluster(n=N)`` + a hand-written ``init_process_group``
  on every engine (``import torch`` in each engine, gloo over loopback, one
  torch thread): that is "raw ipyparallel to a ready group";
* dpnb: ``dpnb.start(N, threads=1)``.

Start (until the group is ready) and stop (until every process is gone) are
timed one side after the other, the order alternating with N.  The
operations in between run side by side, alternating A B A B call by call
(the other side's engines sit idle meanwhile): a ``pass`` cell, a cell that
prints on every rank, a small all_reduce cell, push and pull of a 1 MB
value, a status query (raw: ``queue_status``) and a cell that raises on every
rank (time to the error).  Each row gives both medians of ``--cells`` calls
and the median of the per-round ratios, which follows the machine's drift
far less than the ratio of medians.  Memory: RSS and unique memory
(``Private_*`` of smaps_rollup: what one more engine costs) per engine, medians.

    python benchmarks/scale.py [--ns 2,8,16,32] [--cells 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

from alone import private_mib  # benchmarks/ is on the path when this runs as a script

ONE_MB = b"x" * (1 << 20)
#: untimed calls of each side before each timed series: the first cells after
#: a start run while the engines still settle (forked engines touch their
#: copy-on-write pages)
WARMUP = 2
RAISE = "raise ValueError('bench')"


def _median_mib(pids, measure) -> float:
    """Median of ``measure(pid)`` over the engines still there."""
    out = []
    for p in pids:
        try:
            out.append(measure(p))
        except (psutil.Error, OSError):
            pass
    return statistics.median(out) if out else float("nan")


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _init_group(rank: int, world: int, port: int) -> int:
    """Runs on a raw engine: what a user writes by hand to get a gloo group."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    globals().update(torch=torch, dist=dist, rank=rank)
    return os.getpid()


def _raising(run, exc):
    """A call of ``run`` that must raise ``exc``: the error report, timed."""
    def call():
        try:
            run()
        except exc:
            return
        raise AssertionError("the cell did not raise")

    return call


def _px_way(view, code: str) -> None:
    """A cell the way ``%%px`` (and ``%%dp``) runs it: not silent, so the last
    expression's value comes back and every engine publishes its input on
    IOPub, and waiting for each engine's idle status so no late output is lost."""
    ar = view.execute(code, silent=False, block=False)
    ar.get()
    ar.wait_for_output(5)


class Raw:
    def start(self, n: int) -> None:
        import socket

        import ipyparallel as ipp

        self.ipp = ipp
        self.cluster = ipp.Cluster(n=n, log_level=40)
        self.client = self.cluster.start_and_connect_sync(n=n)
        self.view = self.client[:]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ars = [self.client[i].apply_async(_init_group, i, n, port) for i in range(n)]
        self.pids = [ar.get(300) for ar in ars]

    def ops(self) -> dict:
        v, err = self.view, self.ipp.error.CompositeError
        return {
            "pass cell": lambda: v.execute("pass").get(),
            "pass cell, %%px way": lambda: _px_way(v, "pass"),
            "print cell": lambda: v.execute("print(rank)").get(),
            "all_reduce cell": lambda: v.execute("t = torch.ones(4)\ndist.all_reduce(t)").get(),
            "push 1 MB": lambda: v.push({"blob": ONE_MB}, block=True),
            "pull 1 MB": lambda: v.pull("blob", block=True),
            "status": self.client.queue_status,
            "error report": _raising(lambda: v.execute(RAISE).get(), err),
            "error report, %%px way": _raising(lambda: _px_way(v, RAISE), err),
        }

    def stop(self) -> None:
        procs = [psutil.Process(p) for p in self.pids if psutil.pid_exists(p)]
        self.client.close()
        self.cluster.stop_cluster_sync()
        psutil.wait_procs(procs, timeout=30)


class Dpnb:
    def start(self, n: int) -> None:
        import dpnb

        self.dpnb = dpnb
        self.c = dpnb.start(n, threads=1)
        self.pids = [r.pid for r in self.c.ranks]

    def ops(self) -> dict:
        c, err = self.c, self.dpnb.RemoteCellError
        run = lambda code: c.run(code, display=False)  # noqa: E731
        return {
            "pass cell": lambda: run("pass"),
            # %%dp shows values and waits for output: it is the %%px way
            "pass cell, %%px way": lambda: run("pass"),
            "print cell": lambda: run("print(rank)"),
            "all_reduce cell": lambda: run("t = torch.ones(4)\ndist.all_reduce(t)"),
            "push 1 MB": lambda: c.push({"blob": ONE_MB}),
            "pull 1 MB": lambda: c.pull("blob"),
            "status": c.status,
            "error report": _raising(lambda: run(RAISE), err),
            "error report, %%px way": _raising(lambda: run(RAISE), err),
        }

    def stop(self) -> None:
        self.c.stop()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(sides: dict, cells: int) -> dict:
    """Every operation on both sides, alternating call by call."""
    ops = {name: side.ops() for name, side in sides.items()}
    out: dict = {}
    for op in ops["dpnb"]:
        k = max(3, cells // 3) if op.startswith("error") else cells
        for name in sides:
            for _ in range(WARMUP):
                ops[name][op]()
        got: dict = {name: [] for name in sides}
        for i in range(k):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                got[name].append(_timed(ops[name][op]))
        ratios = [d / r for d, r in zip(got["dpnb"], got["raw"])]
        out[op] = {name: statistics.median(v) for name, v in got.items()}
        out[op]["ratio"] = statistics.median(ratios)
    return out


def run_n(n: int, cells: int, first: str) -> dict:
    sides = {"dpnb": Dpnb(), "raw": Raw()}
    order = [first] + [s for s in sides if s != first]
    res: dict = {"start": {}, "stop": {}}
    try:
        for name in order:
            res["start"][name] = _timed(lambda: sides[name].start(n))
        res.update(side_by_side(sides, cells))
        res["engine RSS MiB"] = {name: _median_mib(s.pids, _rss_mib) for name, s in sides.items()}
        # unique: pages no other process shares (what one more engine costs)
        res["engine unique MiB"] = {name: _median_mib(s.pids, private_mib)
                                    for name, s in sides.items()}
    finally:
        for name in order:
            if hasattr(sides[name], "pids"):
                res["stop"][name] = _timed(sides[name].stop)
    for key in ("start", "stop", "engine RSS MiB", "engine unique MiB"):
        res[key]["ratio"] = res[key]["dpnb"] / res[key]["raw"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="2,8,16,32")
    ap.add_argument("--cells", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for i, n in enumerate(int(x) for x in args.ns.split(",")):
        res = run_n(n, args.cells, "dpnb" if i % 2 == 0 else "raw")
        print(f"N={n}: " + "; ".join(f"{k} {v['dpnb']:.4g} vs {v['raw']:.4g} ({v['ratio']:.2f}x)"
                                     for k, v in res.items()), flush=True)
        rows.append((n, res))
    print("\n| N | what | dpnb | raw ipyparallel | ratio |\n|---|---|---|---|---|")
    for n, res in rows:
        for k, v in res.items():
            mib = "MiB" in k
            fmt = (lambda x: f"{x:.0f} MiB") if mib else (
                lambda x: f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")
            print(f"| {n} | {k} | {fmt(v['dpnb'])} | {fmt(v['raw'])} | {v['ratio']:.2f} |")


if __name__ == "__main__":
    main()
