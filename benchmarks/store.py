"""What the authenticated rendezvous store costs at group formation, and per call after it.

    python benchmarks/store.py --ns 2,4,8 --rounds 7
    python benchmarks/store.py --ns "" --calls 2000     # per-call round trips only

N long-lived worker processes form a gloo group again and again:
``init_process_group`` + one ``new_group`` + a barrier, then tear it down.
Each round forms once through torch's ``TCPStore`` and once through dpnb's
``AuthStore`` (:mod:`dpnb.engine.group.authstore`), in alternating order; a
formation's time is the slowest rank's.  The ratio is the median of the
per-round ratios.

After formation the store is not idle under NCCL: torch's heartbeat monitor
checks the default group's store for a dump signal about once a second
(``TORCH_NCCL_COORD_CHECK_MILSEC``, when dumps on timeout are on), and the
watchdog sets keys through it on a timeout or error.  ``--calls`` times one
``check`` and one ``get`` round trip through a ``PrefixStore`` (as c10d wraps
the default store) from a client process to rank 0's server, TCPStore (C++
both ends) against AuthStore (a Python store: torch's trampoline takes the
client's GIL, rank 0's asyncio server takes rank 0's), idle and with a Python
thread spinning in both processes (a training loop holding the GIL).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKEN = "benchmark-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, n: int, q_in, q_out) -> None:
    import torch
    import torch.distributed as dist

    from dpnb.engine.group.authstore import AuthStore, StoreServer

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    while True:
        msg = q_in.get()
        if msg is None:
            return
        kind, port = msg
        server = None
        t0 = time.perf_counter()
        if kind == "tcp":
            store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timeout)
        else:
            if rank == 0:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(1024)
                server = StoreServer(sock, TOKEN)
            store = AuthStore("127.0.0.1", port, TOKEN, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
        g = dist.new_group()
        dist.barrier(group=g)
        dt = time.perf_counter() - t0
        dist.barrier()
        dist.destroy_process_group()
        del store
        if server is not None:
            server.close()
        q_out.put((rank, dt))


def bench(n: int, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    q_out = ctx.Queue()
    qs = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=_worker, args=(r, n, qs[r], q_out), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    times: dict[str, list[float]] = {"tcp": [], "auth": []}
    try:
        for i in range(rounds + 1):  # round 0 warms both paths up, not counted
            order = ("tcp", "auth") if i % 2 else ("auth", "tcp")
            for kind in order:
                port = _free_port()
                for q in qs:
                    q.put((kind, port))
                worst = max(q_out.get(timeout=120)[1] for _ in range(n))
                if i:
                    times[kind].append(worst)
    finally:
        for q in qs:
            q.put(None)
        for p in procs:
            p.join(10)
    ratios = [a / t for a, t in zip(times["auth"], times["tcp"])]
    return {"n": n, "tcp_ms": statistics.median(times["tcp"]) * 1000,
            "auth_ms": statistics.median(times["auth"]) * 1000,
            "ratio": statistics.median(ratios)}


def _spin(stop) -> None:
    """A Python loop that wants the GIL all the time, as a training step's Python does."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _caller(kind: str, port: int, calls: int, busy: bool, q_out) -> None:
    import threading

    import torch.distributed as dist

    from dpnb.engine.group.authstore import AuthStore

    timeout = timedelta(seconds=30)
    base = (dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout) if kind == "tcp"
            else AuthStore("127.0.0.1", port, TOKEN, timeout))
    store = dist.PrefixStore("default_pg", base)
    store.set("present", "1")
    stop = threading.Event()
    if busy:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    out = {}
    for op, fn in (("check", lambda: store.check(["dump"])), ("get", lambda: store.get("present"))):
        for _ in range(20):  # warm
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[op] = (time.perf_counter() - t0) / calls * 1e6
    stop.set()
    q_out.put(out)


def bench_calls(kind: str, calls: int, busy: bool) -> dict:
    """Per-call µs of check / get from a client process to this process's server."""
    import threading

    import torch.distributed as dist

    from dpnb.engine.group.authstore import StoreServer

    port, server, master = _free_port(), None, None
    if kind == "tcp":
        master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30),
                               wait_for_workers=False)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(16)
        server = StoreServer(sock, TOKEN)
    stop = threading.Event()
    if busy:  # rank 0's own training loop
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_caller, args=(kind, port, calls, busy, q), daemon=True)
    p.start()
    try:
        return q.get(timeout=300)
    finally:
        stop.set()
        p.join(10)
        if server is not None:
            server.close()
        del master


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=0, help="per-call round trips (0: skip)")
    a = ap.parse_args()
    if a.calls:
        print("| GIL | call | TCPStore (µs) | dpnb AuthStore (µs) | ratio |")
        print("|---|---|---|---|---|")
        for busy in (False, True):
            tcp, auth = bench_calls("tcp", a.calls, busy), bench_calls("auth", a.calls, busy)
            for op in ("check", "get"):
                print(f"| {'busy' if busy else 'idle'} | {op} | {tcp[op]:.0f} | {auth[op]:.0f} | "
                      f"{auth[op] / tcp[op]:.1f} |", flush=True)
    if not a.ns:
        return
    print("| ranks | TCPStore formation (ms) | dpnb AuthStore (ms) | ratio |")
    print("|---|---|---|---|")
    for n in (int(x) for x in a.ns.split(",")):
        r = bench(n, a.rounds)
        print(f"| {n} | {r['tcp_ms']:.1f} | {r['auth_ms']:.1f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
