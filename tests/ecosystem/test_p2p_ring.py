"""A ring all-reduce written by hand with send/recv, as course notebooks write it
(reduce-scatter then all-gather over ``tensor_split`` chunks, ``isend`` to the
right, ``recv`` from the left), on 4 ranks over a 10-float tensor: chunks of
3, 3, 2, 2.  One index off on one rank made gloo abort that engine (SIGABRT);
the point-to-point check (dpnb.engine.cell.p2pcheck) turns it into the cell's error.
"""

from __future__ import annotations

import time

import pytest

import dpnb
from dpnb.errors import RemoteCellError
from helpers.ecosystem import assert_whole

RING = """
def ring_allreduce(t):
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(t.tensor_split(world))
    for step in range(world - 1):  # reduce-scatter
        s, r = (rank - step) % world, (rank - step - 1 + OFF) % world
        req = dist.isend(chunks[s].clone(), right)
        buf = torch.empty_like(chunks[r])
        dist.recv(buf, left)
        chunks[r] += buf
        req.wait()
    for step in range(world - 1):  # all-gather
        s, r = (rank + 1 - step) % world, (rank - step) % world
        req = dist.isend(chunks[s].clone(), right)
        buf = torch.empty_like(chunks[r])
        dist.recv(buf, left)
        chunks[r].copy_(buf)
        req.wait()
    return t

x = torch.arange(10.) * (rank + 1)
ring_allreduce(x)
"""


@pytest.fixture(scope="module")
def c4():
    cl = dpnb.start(4, threads=1)  # 4 ranks on 2 cores; the group timeout is torch's 30 min
    yield cl
    cl.stop()


def test_a_correct_hand_written_ring_gives_the_sum(c4):
    assert c4.run(RING.replace("OFF", "0"), display=False).ok
    want = [10.0 * i for i in range(10)]  # sum over ranks of (rank + 1) * arange(10)
    assert [t.tolist() for t in c4.pull("x")] == [want] * 4
    # batch_isend_irecv (P2POp lists) goes through the same check
    r = c4.run("z = torch.zeros(3)\nops = [dist.P2POp(dist.isend, torch.ones(3) * rank, "
               "(rank + 1) % 4), dist.P2POp(dist.irecv, z, (rank - 1) % 4)]\n"
               "for q in dist.batch_isend_irecv(ops):\n    q.wait()\n", display=False)
    assert r.ok and [t.tolist() for t in c4.pull("z")] == [[(k - 1) % 4] * 3 for k in range(4)]


def test_a_ring_with_one_index_off_is_an_error_naming_both_ends(c4):
    pids = [r.pid for r in c4.ranks]
    code = RING.replace("OFF", "(1 if rank == 3 else 0)")
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c4.run(code, display=False)
    took = time.monotonic() - t0
    err = ei.value
    assert took < 10.0, took  # released, not the group timeout (torch's 30 min)
    assert err.summary.startswith("rank 3 raised PointToPointMismatchError"), err.summary
    # rank 3's second step: it expects chunk 2 (2 floats) where rank 2 sends chunk 1 (3
    # floats) -- the message gloo aborted the receiver on
    assert ("rank 3's recv at cell line 9 expects 2 float32 (shape [2]) from rank 2, whose send "
            "at cell line 7 sends 3 float32 (shape [3])") in err.report, err.report
    assert not c4.dead
    assert_whole(c4, pids)
