"""Two links, told apart: loopback inside a host, a 1 Gbit/s throttled link between hosts.

The flat all-reduce crosses the slow link; the two-level one sends only S/g
per rank across it.  The view fits each link on its own (issue 13, point 7)."""

import sys

import pytest

import dpnb
from dpnb.widgets import comm, hierarchy

MiB = 1 << 20
RATE_BPS = 1e9 / 8  # tbf rate 1gbit, bytes per second


@pytest.fixture(scope="module")
def throttled(two_hosts):
    a, b = two_hosts.hosts
    two_hosts.throttle("1gbit")
    c = dpnb.start(4, engines="ssh", ssh_config=two_hosts.ssh_config, timeout=60,
                   remote_python=sys.executable, launcher_args=[f"{a.name}=2", f"{b.name}=2"])
    yield c
    c.stop()


def test_links_are_fitted_apart_and_both_algorithms_sum_alike(throttled):
    assert comm.spans_hosts(throttled)  # %dp bench allreduce takes the two-link path here
    hb = hierarchy.bench(throttled, sizes=[MiB, 4 * MiB, 16 * MiB], iters=2)
    assert (hb.hosts, hb.per_host, hb.equal, hb.pretend) == (2, 2, True, False)
    d = hierarchy.data(hb)
    # The throttled wire, not loopback (GB/s): a rank gets between half the
    # link (both ranks of a host send across it at once) and all of it (their
    # sends do not overlap) -- CI fitted 96 MB/s once, over a 0.75 x rate
    # bound, so the bound is the wire itself, with room for tbf's 256 KB burst
    assert d.inter.bandwidth_Bps < 1.2 * RATE_BPS, d.inter
    assert d.intra.bandwidth_Bps > 3 * d.inter.bandwidth_Bps, (d.intra, d.inter)
    text = hierarchy.text(d)
    assert "2 hosts × 2 ranks" in text and "inter-host link" in text
