"""Flat vs two-level all-reduce across two hosts, on a throttled link, beside the model.

Two hosts are built from network namespaces on this machine (see
``tests/helpers/hosts.py``; root only), 2 ranks each over ssh.  The link of
each host is limited with ``tc ... tbf rate RATE`` both ways (``netem`` is
not available in this kernel).  For each size, in one run on the same
ranks, :func:`dpnb.engine.metrics.hierbench.bench_hierarchical` times the flat
all-reduce, each phase of the two-level one (intra-host reduce-scatter,
inter-host all-reduce of S/g, intra-host all-gather), and each link alone;
the table sets them beside :func:`dpnb.core.hierarchical_allreduce_time`
with the two fitted links (what ``%dp bench allreduce`` shows on a
multi-host cluster).

    python benchmarks/hierarchical.py [--rate 1gbit] [--iters 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.hosts import Hosts  # noqa: E402

MiB = 1 << 20


def main() -> None:
    import dpnb
    from dpnb.widgets import hierarchy

    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit", help="tbf rate of each host's link ('none': unthrottled)")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    with Hosts(2) as hs:
        a, b = hs.hosts
        if args.rate != "none":
            hs.throttle(args.rate)
        c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, remote_python=sys.executable,
                       launcher_args=[f"{a.name}=2", f"{b.name}=2"], timeout=60)
        try:
            hb = hierarchy.bench(c, sizes=[MiB, 4 * MiB, 16 * MiB, 64 * MiB], iters=args.iters)
            print(f"link between hosts: tbf {args.rate}")
            print(hierarchy.text(hierarchy.data(hb)))
        finally:
            c.stop()


if __name__ == "__main__":
    main()
