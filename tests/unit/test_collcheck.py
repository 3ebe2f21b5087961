"""The collective check: fingerprints, the agreed-period rule (proved safe by
simulation), and the star of check connections over real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.engine.cell.checkstar import Star
from dpnb.engine.cell.collcheck import (CheckReleased, CollectiveMismatchError, Pattern, describe,
                                   digest, pairing_notes)


class _T:
    """A tensor as the fingerprint sees it."""

    def __init__(self, *shape, dtype="torch.float32", device="cpu"):
        self.shape, self.dtype = shape, dtype
        self.device = type("D", (), {"type": device})()


def test_describe_names_op_shape_dtype_and_root():
    assert describe("all_reduce", {"tensor": _T(4)}) == "all_reduce [4] float32"
    assert describe("all_reduce", {"tensor": _T(2, 3), "op": type("R", (), {"name": "MAX"})()}) \
        == "all_reduce [2, 3] float32 op=MAX"
    assert describe("broadcast", {"tensor": _T(3), "src": 1}) == "broadcast [3] float32 src=1"
    assert describe("all_reduce", {"tensor": _T(4, device="cuda")}) == \
        "all_reduce [4] float32 on cuda"


def test_lists_only_the_root_passes_do_not_count():
    # gather: only dst holds gather_list; the fingerprints must still agree
    root = describe("gather", {"tensor": _T(4), "gather_list": [_T(4), _T(4)], "dst": 0})
    other = describe("gather", {"tensor": _T(4), "gather_list": None, "dst": 0})
    assert root == other
    # all_to_all: per-rank shapes may differ by design; lengths and dtypes count
    a = describe("all_to_all", {"output_tensor_list": [_T(1), _T(2)],
                                "input_tensor_list": [_T(3), _T(1)]})
    b = describe("all_to_all", {"output_tensor_list": [_T(5), _T(2)],
                                "input_tensor_list": [_T(2), _T(2)]})
    assert a == b
    c = describe("all_to_all", {"output_tensor_list": [_T(1)], "input_tensor_list": [_T(3)]})
    assert c != a


def test_digest_is_the_same_in_every_process():
    # str hashes are salted per process; the check's digest must not be
    code = "from dpnb.engine.cell.collcheck import digest; print(digest('all_reduce [4] float32'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed)), check=True).stdout
            for seed in (1, 2)}
    assert outs == {f"{digest('all_reduce [4] float32')}\n"}


def test_pattern_agrees_on_the_shortest_period_seen_twice():
    p = Pattern()
    seq = [1, 2, 1, 2]
    props = []
    for d in seq:
        props.append(p.proposal(d))
        p.record(d, props[-1])
    assert props == [0, 0, 0, 2]
    assert p.repeats(1) and not p.repeats(2)
    p.reset()
    assert not p.repeats(1) and p.proposal(7) == 0


def _simulate(a: list[int], b: list[int]) -> str:
    """Two ranks running the check protocol on their call sequences; asserts
    that whenever both skip the check their calls are equal."""
    pa, pb = Pattern(), Pattern()
    for k, (x, y) in enumerate(zip(a, b)):
        sa, sb = pa.repeats(x), pb.repeats(y)
        if sa and sb:
            assert x == y, f"both skipped call {k} with different calls {x} != {y}"
            pa.record(x)
            pb.record(y)
        elif sa != sb:
            return "deadlock"  # a checker waits on the star, the skipper in gloo: released
        else:
            qa, qb = pa.proposal(x), pb.proposal(y)
            if (x, qa) != (y, qb):
                assert x != y, f"equal calls {x} refused at {k}: proposals {qa} != {qb}"
                return "mismatch"
            pa.record(x, qa)
            pb.record(y, qb)
    return "ok"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 39), st.integers(0, 2)), max_size=3),
       st.lists(st.integers(0, 39), max_size=2))
def test_no_two_ranks_ever_skip_the_check_on_different_calls(a, changes, drops):
    b = list(a)
    for i, v in changes:  # a rank's call differs here and there (an uneven batch)
        if i < len(b):
            b[i] = v
    for i in sorted(drops, reverse=True):  # ... or a rank skips a call (a branch)
        if i < len(b):
            del b[i]
    _simulate(a, b)


def test_identical_loops_end_up_skipping_the_check():
    pa = Pattern()
    checked = 0
    for d in [5, 6] * 10:
        if pa.repeats(d):
            pa.record(d)
        else:
            checked += 1
            pa.record(d, pa.proposal(d))
    assert checked == 4  # two periods checked, the rest agreed


# ------------------------------------------------------------------ the star
class _Store:
    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = v.encode() if isinstance(v, str) else v
            self.cv.notify_all()

    def get(self, k):
        with self.cv:
            self.cv.wait_for(lambda: k in self.d, timeout=10)
            return self.d[k]


def _stars(world: int, token: str = "t0k") -> list[Star]:
    store, out = _Store(), [None] * world

    def form(r):
        out[r] = Star.form(store, r, world, "127.0.0.1", token, 1, 10.0)

    ts = [threading.Thread(target=form, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    return out


def _all(stars, calls, sites=None):
    res = [None] * len(stars)
    sites = sites or [("<cell>", 1)] * len(stars)

    def go(r):
        try:
            res[r] = stars[r].call("all_reduce", calls[r], digest(calls[r]), sites[r])
        except Exception as e:  # collected for the assertions
            res[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(len(stars))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    return res


def test_star_passes_equal_calls_and_names_every_rank_on_a_mismatch():
    stars = _stars(3)
    assert _all(stars, ["all_reduce [4] float32"] * 3) == [True, True, True]
    res = _all(stars, ["all_reduce [4] float32", "all_reduce [5] float32", "all_reduce [4] float32"])
    assert all(isinstance(e, CollectiveMismatchError) for e in res), res
    assert len({str(e) for e in res}) == 1  # every rank raises the same table
    assert "rank 1: all_reduce [5] float32 at cell line 1" in str(res[0])
    # nothing ran, and the channel is still in step: the next call checks fine
    assert _all(stars, ["barrier"] * 3) == [True, True, True]
    for s in stars:
        s.close()


def test_a_stranger_without_the_token_is_refused_and_the_ranks_still_join():
    store = _Store()
    out = [None, None]

    def hub():
        out[0] = Star.form(store, 0, 2, "127.0.0.1", "secret", 1, 10.0)

    t = threading.Thread(target=hub)
    t.start()
    port = int(store.get("dpnb/collcheck/1"))
    stranger = socket.create_connection(("127.0.0.1", port))
    stranger.sendall(b"\x01\x00\x00\x00" + b"x" * 32)  # claims rank 1, wrong MAC
    out[1] = Star.form(store, 1, 2, "127.0.0.1", "secret", 1, 10.0)
    t.join(15)
    assert sorted(out[0].spokes) == [1]
    assert stranger.recv(1) == b""  # dropped
    assert _all(out, ["barrier", "barrier"]) == [True, True]


def test_a_release_frees_a_rank_waiting_in_the_check():
    stars = _stars(2)
    res = [None]

    def hub():
        try:
            stars[0].call("all_reduce", "x", digest("x"))
        except CheckReleased as e:
            res[0] = e

    t = threading.Thread(target=hub)
    t.start()
    deadline = threading.Event()
    while stars[0].awaiting() != [1] and not deadline.wait(0.01):
        pass
    assert stars[0].awaiting() == [1]  # the hub waits for rank 1
    stars[0].spokes[1].shutdown(socket.SHUT_RDWR)  # what the side door's release does
    t.join(5)
    assert isinstance(res[0], CheckReleased) and "Connection closed by peer" in str(res[0])
    with pytest.raises(CheckReleased, match="cannot continue"):
        stars[0].call("all_reduce", "x", digest("y"))


def test_calls_paired_across_lines_are_kept_on_every_rank_and_still_run():
    stars = _stars(3)
    call = "all_reduce [3] float32"
    sites = [("<cell>", 3), ("<cell>", 5), ("<cell>", 5)]
    assert _all(stars, [call] * 3, sites) == [True, True, True]  # ran: not an error
    assert _all(stars, [call] * 3) == [True, True, True]  # one line: nothing kept
    want = [{"op": "all_reduce", "seq": 1,
             "sites": {0: "cell line 3", 1: "cell line 5", 2: "cell line 5"}}]
    assert [s.paired for s in stars] == [want] * 3
    assert pairing_notes(want, []) == [
        "rank 0's all_reduce at cell line 3 was paired with ranks 1,2's all_reduce at cell "
        "line 5: both results mix values from different lines"]
    three = dict(want[0], sites={0: "cell line 3", 1: "cell line 5", 2: "cell line 7"})
    assert pairing_notes([three], []) == [
        "all_reduce was called from different lines (rank 0 at cell line 3; rank 1 at cell "
        "line 5; rank 2 at cell line 7): each result mixes values from these lines"]
    for s in stars:
        s.close()


def test_two_ranks_paired_across_lines_read_as_one_sentence():
    paired = [{"op": "all_reduce", "seq": 4, "sites": {"0": "cell line 3", "1": "train.py line 9"}}]
    assert pairing_notes(paired * 2, []) == [  # the same pairing twice: said once
        "rank 0's all_reduce at cell line 3 was paired with rank 1's all_reduce at train.py "
        "line 9: both results mix values from different lines"]


def test_a_loop_whose_line_moves_is_not_agreed_but_a_branch_per_rank_is():
    # sites count in the proposal: rank b alternates lines, so no period agrees
    pa, pb = Pattern(), Pattern()
    for i in range(6):
        qa, qb = pa.proposal(7, ("<cell>", 3)), pb.proposal(7, ("<cell>", 4 + i % 2))
        pa.record(7, qa, ("<cell>", 3))
        pb.record(7, qb, ("<cell>", 4 + i % 2))
    assert qa == 1 and qb == 2  # the hub agrees on neither: every call stays checked
    # a skipped call from another line than a period earlier is found (for the note)
    pb.period = 2
    assert pb.repeats(7) and pb.moved(("<cell>", 9)) == ("<cell>", 4)
    assert pb.moved(("<cell>", 4)) is None
