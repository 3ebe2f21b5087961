"""Start, cell, restart and stop of a two-host ssh cluster: dpnb's host agents against ipyparallel's ssh launcher.

Two hosts are built from network namespaces on this machine (see
``tests/helpers/hosts.py``; root only), 2 engines each.  Each round runs
both sides one after the other (order alternating): dpnb ``start`` to a
formed group and ``stop``; raw ipyparallel ``Cluster(engines="ssh")`` with the
same hosts, ssh config and remote Python, ``start_and_connect`` to 4
registered engines (no group: raw is given that for free) and
``stop_cluster``.  Cell: the median of 20 round trips of a one-line cell on
all 4 ranks (dpnb ``run``; raw ``execute(...).get()`` on all engines).
Restart (dpnb only: raw ipyparallel has no "replace rank 3 on its host"):
SIGKILL rank 3's engine through its host's agent, then ``restart`` until the
group is re-formed with rank 3 back on its host.  Prints medians and ratios.

    python benchmarks/multihost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.hosts import Hosts  # noqa: E402
from timing import median_call  # noqa: E402


CELLS = 20


def dpnb_side(hs) -> dict:
    import dpnb

    a, b = hs.hosts
    t0 = time.perf_counter()
    c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, remote_python=sys.executable,
                   launcher_args=[f"{a.name}=2", f"{b.name}=2"], timeout=20)
    t1 = time.perf_counter()
    cell = median_call(lambda: c.run("x = 1", display=False), CELLS)
    c.kill_rank(3)
    t2 = time.perf_counter()
    c.restart()
    restart = time.perf_counter() - t2
    t3 = time.perf_counter()
    c.stop()
    return {"start": t1 - t0, "cell": cell, "restart": restart, "stop": time.perf_counter() - t3}


def raw_side(hs) -> dict:
    import ipyparallel as ipp

    a, b = hs.hosts
    prof = tempfile.mkdtemp(prefix="dpnb-bench-ipp-")
    c = ipp.Cluster(n=4, engines="ssh", controller_ip=hs.bridge_ip, profile_dir=prof)
    cfg = c.config.SSHEngineSetLauncher
    cfg.engines = {a.name: 2, b.name: 2}
    cfg.remote_python = sys.executable
    cfg.ssh_args = ["-F", hs.ssh_config]
    cfg.scp_args = ["-F", hs.ssh_config]
    # the "hosts" share this machine's disk: a remote profile of its own, or scp
    # would copy the connection files onto themselves
    cfg.remote_profile_dir = prof + "-remote"
    t0 = time.perf_counter()
    client = c.start_and_connect_sync(n=4)
    t1 = time.perf_counter()
    view = client[:]
    cell = median_call(lambda: view.execute("x = 1").get(), CELLS)
    client.close()
    t2 = time.perf_counter()
    c.stop_cluster_sync()
    t3 = time.perf_counter()
    shutil.rmtree(prof, ignore_errors=True)
    shutil.rmtree(prof + "-remote", ignore_errors=True)
    return {"start": t1 - t0, "cell": cell, "stop": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"dpnb": [], "raw": []}
    with Hosts(2) as hs:
        for i in range(args.rounds):
            sides = [("dpnb", dpnb_side), ("raw", raw_side)]
            for name, fn in (sides if i % 2 == 0 else sides[::-1]):
                res[name].append(fn(hs))
                print(f"round {i} {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in res[name][-1].items()),
                      flush=True)
    for label in ("start", "cell", "restart", "stop"):
        d = statistics.median(r[label] for r in res["dpnb"])
        if label in res["raw"][0]:
            r = statistics.median(x[label] for x in res["raw"])
            print(f"{label}: dpnb {d:.3f} s, raw ipyparallel ssh {r:.3f} s, ratio {d / r:.2f}")
        else:
            print(f"{label}: dpnb {d:.3f} s (no raw ipyparallel counterpart)")

if __name__ == "__main__":
    main()
