"""The health's incident log (dpnb.cluster.types.Health, dpnb.core.incidents)."""

from dpnb.cluster.types import MAX_INCIDENTS, Health
from dpnb.core.incidents import Incident, rows, text


def test_faults_are_logged_once_and_healthy_only_after_a_fault():
    h = Health()
    h.group_formed(all_settled=True)  # a plain re-form with nothing wrong: nothing to say
    assert list(h.incidents) == []
    h.still_busy(0)
    h.still_busy(0)  # the same fault twice is one incident
    h.group_broken("released")
    h.group_broken("again")  # already broken
    h.group_formed()  # the group is back, but rank 0 still runs its old call
    assert [i.kind for i in h.incidents] == ["still busy", "group broken"]
    h.settled(0)
    assert [i.kind for i in h.incidents] == ["still busy", "group broken", "healthy"]
    h.died(1, "killed by signal 9 (SIGKILL)")
    h.group_broken("it cannot continue without rank 1")
    h.replaced([1])
    h.group_formed()
    assert [i.kind for i in h.incidents][3:] == ["died", "group broken", "replaced", "healthy"]
    for _ in range(MAX_INCIDENTS + 5):  # bounded
        h.still_busy(0)
        h.settled(0)
    assert len(h.incidents) == MAX_INCIDENTS


def test_rows_pair_each_fault_with_its_time_to_healthy():
    inc = [Incident(100.0, "died", (1,), "SIGKILL"), Incident(101.0, "group broken"),
           Incident(103.5, "replaced", (1,)), Incident(104.0, "healthy"),
           Incident(110.0, "still busy", (0,), "the notebook stopped waiting")]
    got = rows(inc, started=90.0)
    assert [(r.at_s, r.kind, r.healthy_after_s) for r in got] == [
        (10.0, "died", 4.0), (11.0, "group broken", 3.0), (20.0, "still busy", None)]
    out = text(got)
    assert "died         rank 1: SIGKILL (healthy 4.0 s later)" in out
    assert "still busy   rank 0: the notebook stopped waiting (not healthy since)" in out
    assert text([]).startswith("no incidents")
