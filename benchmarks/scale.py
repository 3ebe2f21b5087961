"""dpnb against raw ipyparallel at N = 2, 8, 16, 32 local CPU engines (one torch thread each).

For each N, both sides run one after the other (order alternating with N),
on the same machine, each with N engines of its own:

* raw: ``ipyparallel.Cluster(n=N)`` + a hand-written ``init_process_group``
  on every engine (``import torch`` in each engine, gloo over loopback, one
  torch thread): that is "raw ipyparallel to a ready group";
* dpnb: ``dpnb.start(N, threads=1)``.

Then the same operations on both: a ``pass`` cell, a cell that prints on
every rank, a small all_reduce cell, push and pull of a 1 MB value, a status
query (raw: ``queue_status``), a cell that raises on every rank (time to the
error), and stop (until every process is gone).  Memory: RSS per engine
(median) and of this (notebook) process.  Cells: median of ``--cells``.

    python benchmarks/scale.py [--ns 2,8,16,32] [--cells 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil
from timing import median_call

ONE_MB = b"x" * (1 << 20)
#: untimed calls before each timed series: the first cells after a start
#: run while the engines still settle (forked engines touch their
#: copy-on-write pages), on both sides
WARMUP = 2


def _rss_mib(pids) -> float:
    out = []
    for p in pids:
        try:
            out.append(psutil.Process(p).memory_info().rss / 2**20)
        except psutil.Error:
            pass
    return statistics.median(out) if out else float("nan")


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


RAISE = "raise ValueError('bench')"


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


def raw_side(n: int, cells: int) -> dict:
    import socket

    import ipyparallel as ipp

    out: dict = {}
    t0 = time.perf_counter()
    c = ipp.Cluster(n=n, log_level=40)
    client = c.start_and_connect_sync(n=n)
    view = client[:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ars = [client[i].apply_async(_init_group, i, n, port) for i in range(n)]
    pids = [ar.get(300) for ar in ars]
    out["start"] = time.perf_counter() - t0
    out["pass cell"] = median_call(lambda: view.execute("pass").get(), cells, WARMUP)
    out["pass cell, %%px way"] = median_call(lambda: _px_way(view, "pass"), cells, WARMUP)
    out["print cell"] = median_call(lambda: view.execute("print(rank)").get(), cells, WARMUP)
    out["all_reduce cell"] = median_call(
        lambda: view.execute("t = torch.ones(4)\ndist.all_reduce(t)").get(), cells, WARMUP)
    out["push 1 MB"] = median_call(lambda: view.push({"blob": ONE_MB}, block=True), cells, WARMUP)
    out["pull 1 MB"] = median_call(lambda: view.pull("blob", block=True), cells, WARMUP)
    out["status"] = median_call(client.queue_status, cells, WARMUP)
    out["error report"] = median_call(
        _raising(lambda: view.execute(RAISE).get(), ipp.error.CompositeError), max(3, cells // 3), WARMUP)
    out["error report, %%px way"] = median_call(
        _raising(lambda: _px_way(view, RAISE), ipp.error.CompositeError), max(3, cells // 3), WARMUP)
    out["engine RSS MiB"] = _rss_mib(pids)
    out["notebook RSS MiB"] = psutil.Process().memory_info().rss / 2**20
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    t1 = time.perf_counter()
    client.close()
    c.stop_cluster_sync()
    psutil.wait_procs(procs, timeout=30)
    out["stop"] = time.perf_counter() - t1
    return out


def dpnb_side(n: int, cells: int) -> dict:
    import dpnb

    out: dict = {}
    t0 = time.perf_counter()
    c = dpnb.start(n, threads=1)
    out["start"] = time.perf_counter() - t0
    out["pass cell"] = median_call(lambda: c.run("pass", display=False), cells, WARMUP)
    out["pass cell, %%px way"] = out["pass cell"]  # %%dp shows values and waits for output
    out["print cell"] = median_call(lambda: c.run("print(rank)", display=False), cells, WARMUP)
    out["all_reduce cell"] = median_call(
        lambda: c.run("t = torch.ones(4)\ndist.all_reduce(t)", display=False), cells, WARMUP)
    out["push 1 MB"] = median_call(lambda: c.push({"blob": ONE_MB}), cells, WARMUP)
    out["pull 1 MB"] = median_call(lambda: c.pull("blob"), cells, WARMUP)
    out["status"] = median_call(c.status, cells, WARMUP)
    out["error report"] = median_call(
        _raising(lambda: c.run(RAISE, display=False), dpnb.RemoteCellError), max(3, cells // 3), WARMUP)
    out["error report, %%px way"] = out["error report"]
    out["engine RSS MiB"] = _rss_mib(r.pid for r in c.ranks)
    out["notebook RSS MiB"] = psutil.Process().memory_info().rss / 2**20
    t1 = time.perf_counter()
    c.stop()
    out["stop"] = time.perf_counter() - t1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="2,8,16,32")
    ap.add_argument("--cells", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for i, n in enumerate(int(x) for x in args.ns.split(",")):
        sides = [("dpnb", dpnb_side), ("raw", raw_side)]
        res = {}
        for name, fn in (sides if i % 2 == 0 else sides[::-1]):
            res[name] = fn(n, args.cells)
            print(f"N={n} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in res[name].items()), flush=True)
        rows.append((n, res))
    print("\n| N | what | dpnb | raw ipyparallel | ratio |\n|---|---|---|---|---|")
    for n, res in rows:
        for k in res["dpnb"]:
            d, r = res["dpnb"][k], res["raw"][k]
            unit = "MiB" if "RSS" in k else "s"
            fmt = (lambda v: f"{v:.0f} MiB") if unit == "MiB" else (
                lambda v: f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s")
            print(f"| {n} | {k} | {fmt(d)} | {fmt(r)} | {d / r:.2f} |")


if __name__ == "__main__":
    main()
