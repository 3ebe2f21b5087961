"""Spare engines (dpnb.cluster.spares): which registered engine is whose spare.

The kernel never learns a spare's engine id when it is forked; a restart finds
it among the controller's engines that never held a rank, by its agent's
location and its PID there.  These tests drive that bookkeeping with a fake
controller and fake agents; ``tests/cluster/test_spares.py`` and the storm
(``tests/multihost/test_storm.py``) run real ones.
"""

from __future__ import annotations

import threading
import time

from dpnb.cluster import spares as sp
from dpnb.cluster.spares import Spares
from dpnb.cluster.types import RankInfo


class Client:
    def __init__(self, ids):
        self.ids = list(ids)


def rank(r, eid, loc, pid):
    return RankInfo(rank=r, engine_id=eid, host=loc, ip="10.0.0.1", pid=pid, local_rank=r % 2,
                    local_world_size=2, node_rank=r // 2, device="cpu", location=loc)


TABLE = [rank(0, 0, "a", 100), rank(1, 1, "a", 101), rank(2, 2, "b", 100), rank(3, 3, "b", 101)]


class Agents:
    """Forks PIDs per host from 200 on (both hosts alike: PID spaces are per host)."""

    def __init__(self):
        self.next = {}
        self.dead: set[tuple[str, int]] = set()
        self.asked = []

    def fork(self, counts):
        self.asked.append(dict(counts))
        out = {}
        for loc, k in counts.items():
            start = self.next.get(loc, 200)
            out[loc] = list(range(start, start + k))
            self.next[loc] = start + k
        return out

    def alive(self, loc, pid):
        return (loc, pid) not in self.dead


def spares_on_both_hosts():
    agents = Agents()
    s = Spares(1, agents.fork, agents.alive)
    s.saw(TABLE)
    s.fill(ri.location for ri in TABLE)
    assert s.pool == {"a": [200], "b": [200]} and agents.asked == [{"a": 1, "b": 1}]
    return s, agents


def probes_of(registered: dict[int, tuple[str, int]]):
    """A probe function answering for the engines of ``registered`` (eid -> (loc, pid))."""
    asked = []

    def probe(eids, within_s, enough):
        asked.append(list(eids))
        return {e: {"host": registered[e][0], "location": registered[e][0],
                    "pid": registered[e][1]} for e in eids if e in registered}, True
    return probe, asked


def test_a_dead_rank_gets_the_spare_of_its_own_host_though_both_spares_have_one_pid():
    """Both hosts' spares are PID 200, each in its own PID space: rank 3 (host b)
    must get engine 5, b's spare, never engine 4 (a's), which stays a's spare."""
    s, _ = spares_on_both_hosts()
    probe, asked = probes_of({4: ("a", 200), 5: ("b", 200)})
    taken = s.take(Client([0, 1, 2, 3, 4, 5]), TABLE, [3], probe)
    assert taken.ranks == (3,) and list(taken.probes) == [5]
    assert asked == [[4, 5]]  # the engines no rank ever held, and only those
    assert s.pool == {"a": [200], "b": []}
    assert 5 in s.seen and 4 not in s.seen


def test_a_host_without_a_spare_left_is_covered_by_none_and_its_rank_starts_cold():
    s, _ = spares_on_both_hosts()
    probe, _ = probes_of({4: ("a", 200), 5: ("b", 200)})
    taken = s.take(Client(range(6)), TABLE, [2, 3], probe)  # both of b's ranks: one spare
    assert taken.ranks == (2,) and list(taken.probes) == [5]


def test_a_replaced_ranks_old_engine_still_listed_is_never_asked():
    """A killed rank's engine stays on the controller's list until its heartbeats
    run out (30 s): it held a rank, so it is not a spare, and a probe sent to it
    would wait on a dead engine."""
    s, _ = spares_on_both_hosts()
    probe, asked = probes_of({4: ("a", 200), 5: ("b", 200)})
    # rank 1 (engine 1) died before; replaced by engine 6, then rank 3 dies
    table = [TABLE[0], rank(1, 6, "a", 300), TABLE[2], TABLE[3]]
    s.saw(table)
    s.take(Client([0, 1, 2, 3, 4, 5, 6]), table, [3], probe)
    assert asked == [[4, 5]]


def test_a_spare_that_never_answers_is_left_and_never_asked_again(monkeypatch):
    """Engine 4 (a's spare) is listed but silent: its probe gives up (PROBE_S), it
    is never asked again, its PID leaves a's pool so the next fill replaces
    it, and the next restart does not wait for it to register."""
    s, agents = spares_on_both_hosts()
    monkeypatch.setattr(sp, "REGISTER_WAIT_S", 0.0)  # both forked "long ago"
    probe, asked = probes_of({5: ("b", 200)})
    taken = s.take(Client(range(6)), TABLE, [0], probe)
    assert taken.ranks == () and 4 in s.seen and s.pool["a"] == []
    assert s.fill(["a"]) == {"a": [201]}
    monkeypatch.setattr(sp, "REGISTER_WAIT_S", 0.5)
    t0 = time.monotonic()
    s.take(Client(range(6)), TABLE, [0], probe)  # a's new spare never registers
    assert asked[-1] == [5] and time.monotonic() - t0 < 2.0


def test_a_spare_forked_moments_ago_is_waited_for_not_taken_for_lost(monkeypatch):
    """A restart right after another: b's new spare registers while the second
    restart looks; it is waited for (up to REGISTER_WAIT_S) and given."""
    s, _ = spares_on_both_hosts()
    client = Client([0, 1, 2, 3, 4])  # b's spare (engine 5) not registered yet
    probe, _ = probes_of({4: ("a", 200), 5: ("b", 200)})
    threading.Timer(0.3, lambda: client.ids.append(5)).start()
    taken = s.take(client, TABLE, [3], probe)
    assert taken.ranks == (3,) and list(taken.probes) == [5]


def test_dead_spares_are_not_waited_for_and_fill_replaces_them():
    s, agents = spares_on_both_hosts()
    agents.dead.add(("b", 200))
    probe, asked = probes_of({4: ("a", 200)})
    taken = s.take(Client(range(5)), TABLE, [3], probe)  # b's spare died: nothing to take
    assert taken.ranks == () and asked == []
    s.fill(["b"])
    assert s.pool["b"] == [201] and agents.asked[-1] == {"b": 1}


def test_fill_asks_only_for_what_a_host_lacks_and_survives_an_agent_that_cannot_fork(caplog):
    s, agents = spares_on_both_hosts()
    assert s.fill(["a", "b"]) == {} and len(agents.asked) == 1

    def broken(counts):
        raise RuntimeError("host b does not answer")

    s._fork = broken
    agents.dead.add(("b", 200))
    assert s.fill(["b"]) == {}
    assert "no spare engine started on b" in caplog.text and "does not answer" in caplog.text


def test_a_dead_spare_still_listed_is_not_waited_for_once_the_needed_host_answered():
    """b's spare (engine 5) died with b's ranks and is still on the controller's
    list, silent; rank 0 of host a dies: the probe stops as soon as a's spare
    answered, and engine 5, not waited out, is not written off either (the
    look was cut short: it may yet answer)."""
    s, _ = spares_on_both_hosts()
    a_spare = {"host": "a", "location": "a", "pid": 200}

    def probe(eids, within_s, enough):
        assert eids == [4, 5]
        assert not enough({}) and not enough({5: {"host": "b", "location": "b", "pid": 999}})
        assert enough({4: a_spare})
        return {4: a_spare}, False

    taken = s.take(Client(range(6)), TABLE, [0], probe)
    assert taken.ranks == (0,) and list(taken.probes) == [4]
    assert 5 not in s.seen and s.pool["b"] == [200]
