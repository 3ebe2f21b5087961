"""The peer copies' plan: K as a user gives it, the holder of each rank's copy, the memory line."""

import pytest

from dpnb.core.errors import UserError
from dpnb.core.peerplan import holders, memory_line, parse_every


@pytest.mark.parametrize("given,want", [("10", 10), (" 3 ", 3), ("off", 0), ("OFF", 0), ("0", 0),
                                        (1, 1), (0, 0), (50, 50)])
def test_parse_every_takes_steps_or_off(given, want):
    assert parse_every(given) == want


@pytest.mark.parametrize("bad", ["-1", "x", "2.5", "", "1e3", -3, True, 2.0, None])
def test_parse_every_refuses_in_one_line_saying_what_to_give(bad):
    with pytest.raises(UserError) as ei:
        parse_every(bad)
    msg = str(ei.value)
    assert "\n" not in msg and "whole number of steps" in msg and "off" in msg and repr(bad) in msg


def _check(hosts):
    h = holders(hosts)
    n = len(hosts)
    assert sorted(h) == list(range(n))  # each rank holds exactly one copy
    assert all(h[r] != r for r in range(n))  # never its own
    return h


def test_one_host_is_the_ring_r_plus_1():
    assert _check(["a"] * 4) == [1, 2, 3, 0]
    assert _check(["a", "a"]) == [1, 0]


def test_two_hosts_every_holder_on_the_other_host():
    for hosts in (["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a"] * 3 + ["b"] * 3):
        h = _check(hosts)
        assert all(hosts[h[r]] != hosts[r] for r in range(len(hosts))), (hosts, h)


def test_uneven_hosts_as_few_on_their_own_host_as_one_copy_each_allows():
    hosts = ["a"] * 4 + ["b"] * 2 + ["c"]  # a holds 4 of 7: at least 2*4-7 = 1 stays on a
    h = _check(hosts)
    assert sum(hosts[h[r]] == hosts[r] for r in range(7)) == 1
    hosts = ["b", "a", "a", "c", "b", "a"]  # 3 of 6: all can leave
    h = _check(hosts)
    assert all(hosts[h[r]] != hosts[r] for r in range(6))


def test_single_rank_holds_its_own():
    assert holders(["a"]) == [0]


def test_memory_line_shows_k_and_each_ranks_bytes():
    line = memory_line(10, [9 * 2**20, 9.5 * 2**20], "zero2")
    assert line.startswith("peer copies every 10 steps: 9.5 MB of CPU memory per rank at most")
    assert "rank 0 9.0 MB, rank 1 9.5 MB" in line and "\n" not in line
    assert memory_line(0, [0, 0], "ddp") == ("peer copies: off (ddp rebuilds a rank from a "
                                             "survivor's replica)")
    assert "disk checkpoint" in memory_line(0, [0, 0], "zero2")


def test_train_magic_refuses_a_bad_interval_in_one_line_before_needing_a_cluster():
    # lazy: IPython's shell only for this case
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from dpnb.magics import DPMagics

    m = DPMagics(InteractiveShell.instance())
    with pytest.raises(UsageError) as ei:
        m.dp("train --steps 1 --peer-copy-every often")
    assert str(ei.value).startswith("--peer-copy-every takes a whole number of steps")
    with pytest.raises(UsageError) as ei:  # a good K gets as far as the missing cluster
        m.dp("train --steps 1 --peer-copy-every off")
    assert "no dpnb cluster is running" in str(ei.value)


def test_the_placement_line_says_where_each_copy_is_and_what_a_lost_host_costs():
    from dpnb.core.peerplan import placement_line

    two = ["a", "a", "b", "b"]
    line = placement_line(holders(two), two)
    assert line.startswith("copies held (rank->holder): 0->2, 1->3, 2->0, 3->1;"), line
    assert "every copy on another host" in line
    lopsided = ["a", "a", "a", "b"]  # more than half on one host: 2a - n = 2 copies stay home
    line = placement_line(holders(lopsided), lopsided)
    same = [r for r, h in enumerate(holders(lopsided)) if lopsided[h] == lopsided[r]]
    assert len(same) == 2 and f"ranks {same[0]}, {same[1]} have their copies on the owner's own " \
        "host" in line and "losing that host loses those shards" in line, (line, same)
    line = placement_line([1, 2, 0], ["a", "a", "b"])  # one copy home: rank 0's, on rank 1
    assert "rank 0 has its copy on the owner's own host" in line, line
    assert "one host" in placement_line(holders(["a", "a"]), ["a", "a"])
    assert placement_line(None, two) is None


def _planned(strategy, hosts, asked=None, wrapped=True):
    from types import SimpleNamespace

    from dpnb.session.replica import planned_placement

    training = SimpleNamespace(last_wrap=object() if wrapped else None, strategy=strategy,
                               peer_copy_every=asked)
    return planned_placement(SimpleNamespace(
        training=training, world_size=len(hosts), ranks=[SimpleNamespace(host=h) for h in hosts]))


def test_status_says_the_planned_placement_without_asking_a_rank():
    """%dp status's line: the interval in force and the holders as the ranks plan them."""
    line = _planned("zero2", ["a", "a", "b", "b"])
    assert line.startswith("peer copies every 10 steps; copies held (rank->holder): "
                           "0->2, 1->3, 2->0, 3->1; every copy on another host"), line
    assert _planned("ddp", ["a", "b"]) is None  # DDP: no copies by default
    assert _planned("ddp", ["a", "b"], asked=5).startswith("peer copies every 5 steps; ")
    assert _planned("zero1", ["a", "a"], asked=0) is None  # switched off
    assert _planned("zero3", ["a", "b"], wrapped=False) is None
    assert _planned("zero3", ["a"]) is None  # one rank: nobody to hold a copy
