"""Open MPI across the two hosts: mpiexec with a hostfile, its ssh agent pointed at the hosts."""

import shutil
import time

import pytest

import dpnb


def _start(hs, hosts, **kw):
    """4 engines through mpiexec, its hostfile listing ``hosts`` in that order, 2 slots each."""
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (apt-get install openmpi-bin)")
    hf = f"{hs.dir}/hostfile-{'-'.join(h.name for h in hosts)}"
    with open(hf, "w") as f:
        f.write("".join(f"{h.ip} slots=2\n" for h in hosts))
    return dpnb.start(4, engines="mpi", timeout=20, start_timeout=90,
                      launcher_args=["--hostfile", hf, "--mca", "plm_rsh_agent",
                                     f"ssh -F {hs.ssh_config}"], **kw)


def test_mpi_hostfile_across_two_hosts(two_hosts):
    hs = two_hosts
    a, b = hs.hosts
    c = _start(hs, [a, b], env=["DPNB_TEST_MPI=1"])
    try:
        assert [(r.host, r.ip, r.local_rank) for r in c.ranks] == \
            [(a.name, a.ip, 0), (a.name, a.ip, 1), (b.name, b.ip, 0), (b.name, b.ip, 1)]
        c.run("import os\nx = torch.ones(1); dist.all_reduce(x)\n"
              "out = (x.item(), os.environ['DPNB_TEST_MPI'], os.environ['GLOO_SOCKET_IFNAME'])",
              display=False)
        assert c.pull("out") == [(4.0, "1", "eth1")] * 4
    finally:
        c.stop()
    deadline = time.monotonic() + 10
    while any(hs.remote_pids(h) for h in hs.hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(hs.remote_pids(h) for h in hs.hosts)


def test_mpi_ranks_follow_the_hostfile_order(two_hosts):
    """The hostfile names b first: rank 0 is on b (Open MPI's world rank decides,
    not which engine registered first)."""
    a, b = two_hosts.hosts
    c = _start(two_hosts, [b, a])
    try:
        assert [r.host for r in c.ranks] == [b.name, b.name, a.name, a.name]
        assert c.master_addr == b.ip
    finally:
        c.stop()
