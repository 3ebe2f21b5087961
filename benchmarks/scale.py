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
(60 by default: enough to tell 0.9 from 1.1 on two shared cores) and the
median of the per-round ratios, which follows the machine's drift far less
than the ratio of medians, with their interquartile range and the count.
Memory: RSS and unique memory (``Private_*`` of smaps_rollup: what one more
engine costs) per engine, medians.

Both sides get the same start timeout (``--start-timeout``, default 60 s plus
2 s per engine: ipyparallel's own default of 60 s gave up at N = 64 here with
55 engines ready); a side that does not start is a row saying why, not a
traceback, and that N's other rows are skipped.

    python benchmarks/scale.py [--ns 2,8,16,32] [--cells 60] [--start-timeout S]
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
    def start(self, n: int, timeout: float) -> None:
        import socket

        import ipyparallel as ipp

        self.ipp = ipp
        self.cluster = ipp.Cluster(n=n, log_level=40, engine_timeout=int(timeout))
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
        if getattr(self, "client", None) is not None:  # not there after a failed start
            self.client.close()
        self.cluster.stop_cluster_sync()
        psutil.wait_procs(procs, timeout=30)


class Dpnb:
    def start(self, n: int, timeout: float) -> None:
        import dpnb

        self.dpnb = dpnb
        self.c = dpnb.start(n, threads=1, start_timeout=timeout)
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
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[op]["spread"] = (q[0], q[2], len(ratios))  # interquartile range, calls
    return out


def run_n(n: int, cells: int, first: str, timeout: float) -> dict:
    sides = {"dpnb": Dpnb(), "raw": Raw()}
    order = [first] + [s for s in sides if s != first]
    res: dict = {"start": {}, "stop": {}}
    try:
        for name in order:
            try:
                res["start"][name] = _timed(lambda: sides[name].start(n, timeout))
            except Exception as e:  # a side that does not start is a row, not a traceback
                msg = (str(e).splitlines() or [""])[0][:160]
                res["failed"] = f"{name} did not start: {type(e).__name__}: {msg}"
                if hasattr(sides[name], "cluster"):  # raw: what it did start
                    sides[name].pids = []
                return res
        res.update(side_by_side(sides, cells))
        res["engine RSS MiB"] = {name: _median_mib(s.pids, _rss_mib) for name, s in sides.items()}
        # unique: pages no other process shares (what one more engine costs)
        res["engine unique MiB"] = {name: _median_mib(s.pids, private_mib)
                                    for name, s in sides.items()}
    finally:
        for name in order:
            if hasattr(sides[name], "pids"):
                try:
                    res["stop"][name] = _timed(sides[name].stop)
                except Exception as e:  # said in the row; the run goes on
                    res.setdefault("failed", f"{name} did not stop: {type(e).__name__}: {e}")
    for key in ("start", "stop", "engine RSS MiB", "engine unique MiB"):
        res[key]["ratio"] = res[key]["dpnb"] / res[key]["raw"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="2,8,16,32")
    ap.add_argument("--cells", type=int, default=60)
    ap.add_argument("--start-timeout", type=float, default=None,
                    help="seconds either side may take to start (default 60 + 2 per engine)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for i, n in enumerate(int(x) for x in args.ns.split(",")):
        timeout = args.start_timeout or 60.0 + 2.0 * n
        res = run_n(n, args.cells, "dpnb" if i % 2 == 0 else "raw", timeout)
        print(f"N={n}: " + "; ".join(
            f"{k} {v}" if k == "failed" else f"{k} {v['dpnb']:.4g} vs {v['raw']:.4g} "
            f"({v['ratio']:.2f}x)" for k, v in res.items() if k == "failed" or "ratio" in v),
            flush=True)
        rows.append((n, res))
    print("\n| N | what | dpnb | raw ipyparallel | ratio (median of per-round) | IQR, calls |"
          "\n|---|---|---|---|---|---|")
    for n, res in rows:
        for k, v in res.items():
            if k == "failed":
                print(f"| {n} | start | {v} | | | |")
                continue
            if "ratio" not in v:
                continue
            mib = "MiB" in k
            fmt = (lambda x: f"{x:.0f} MiB") if mib else (
                lambda x: f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")
            sp = v.get("spread")
            spread = f"{sp[0]:.2f}-{sp[1]:.2f}, {sp[2]}" if sp else "one each"
            print(f"| {n} | {k} | {fmt(v['dpnb'])} | {fmt(v['raw'])} | {v['ratio']:.2f} | {spread} |")


if __name__ == "__main__":
    main()
