"""What breaks first beyond one machine, measured on light processes: rank 0's
rendezvous store (:mod:`dpnb.engine.group.authstore`) under a full-mesh formation.

A gloo group forms through the store: every rank sets its address key and
reads every other rank's, N sets and N (N - 1) gets, all served by rank 0's
one asyncio thread.  Here one process serves the store and ``--procs``
client processes hold N connections between them (threads, one AuthStore
each, each authenticated as a rank's is) and do exactly that; the time is
from the first connection to the last get.  No torch group, no engine: the
store's share of forming a group of N.

    python benchmarks/fanin.py --ns 64,128,256,512 --procs 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "fanin-benchmark"


def _client(port: int, ranks: list[int], n: int, q) -> None:
    from dpnb.engine.group.authstore import AuthStore

    stores = {}
    t0 = time.perf_counter()
    for r in ranks:  # one connection per rank, held while the group forms
        stores[r] = AuthStore("127.0.0.1", port, TOKEN, timedelta(seconds=600))
    connected = time.perf_counter() - t0

    def rank(r: int) -> None:
        s = stores[r]
        s.set(f"rank_{r}", f"address of {r}".encode())
        for peer in range(n):
            if peer != r:
                s.get(f"rank_{peer}")

    ts = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((connected, time.perf_counter() - t0))
    for s in stores.values():
        s.close()


def one(n: int, procs: int) -> tuple[float, float]:
    from dpnb.engine.group.authstore import StoreServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = StoreServer(sock, TOKEN)
    q = mp.get_context("fork").Queue()
    ps = [mp.get_context("fork").Process(target=_client, args=(server.port, list(range(i, n, procs)), n, q))
          for i in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    got = [q.get(timeout=1800) for _ in ps]
    took = time.perf_counter() - t0
    for p in ps:
        p.join()
    server.close()
    return max(c for c, _ in got), took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="64,128,256,512")
    ap.add_argument("--procs", type=int, default=2)
    a = ap.parse_args()
    import torch  # noqa: F401  -- loaded once, before the forks

    print("| N | connect (slowest client) | set + N(N-1) gets, all ranks | gets/s |")
    print("|---|---|---|---|")
    for n in (int(x) for x in a.ns.split(",")):
        connect, took = one(n, a.procs)
        print(f"| {n} | {connect:.2f} s | {took:.2f} s | {n * (n - 1) / took:,.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
