"""Start and stop of a two-host ssh cluster: dpnb's host agents against ipyparallel's ssh launcher.

Two hosts are built from network namespaces on this machine (see
``tests/helpers/hosts.py``; root only), 2 engines each.  Each round runs
both sides one after the other (order alternating): dpnb ``start`` to a
formed group and ``stop``; raw ipyparallel ``Cluster(engines="ssh")`` with the
same hosts, ssh config and remote Python, ``start_and_connect`` to 4
registered engines (no group: raw is given that for free) and
``stop_cluster``.  Prints medians and the dpnb / raw ratios.

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


def dpnb_side(hs) -> tuple[float, float]:
    import dpnb

    a, b = hs.hosts
    t0 = time.perf_counter()
    c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, remote_python=sys.executable,
                   launcher_args=[f"{a.name}=2", f"{b.name}=2"], timeout=20)
    t1 = time.perf_counter()
    c.stop()
    return t1 - t0, time.perf_counter() - t1


def raw_side(hs) -> tuple[float, float]:
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
    client.close()
    c.stop_cluster_sync()
    t2 = time.perf_counter()
    shutil.rmtree(prof, ignore_errors=True)
    shutil.rmtree(prof + "-remote", ignore_errors=True)
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res: dict[str, list[tuple[float, float]]] = {"dpnb": [], "raw": []}
    with Hosts(2) as hs:
        for i in range(args.rounds):
            sides = [("dpnb", dpnb_side), ("raw", raw_side)]
            for name, fn in (sides if i % 2 == 0 else sides[::-1]):
                res[name].append(fn(hs))
                print(f"round {i} {name}: start {res[name][-1][0]:.2f} s, "
                      f"stop {res[name][-1][1]:.2f} s", flush=True)
    for k, label in ((0, "start"), (1, "stop")):
        d = statistics.median(r[k] for r in res["dpnb"])
        r = statistics.median(r[k] for r in res["raw"])
        print(f"{label}: dpnb {d:.2f} s, raw ipyparallel ssh {r:.2f} s, ratio {d / r:.2f}")


if __name__ == "__main__":
    main()
