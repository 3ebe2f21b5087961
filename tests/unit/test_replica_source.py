"""Which survivor a restart rebuilds from: a survivor still busy is not asked.

``replica.source`` waits for survivors still finishing the call their peer's
death failed; one still busy then would refuse the question ("rank 0 still
running an earlier cell": seen once under CI's load), so the restart is told
why memory cannot serve and takes the disk path (it interrupts that rank).
"""

from dpnb.session import replica


class _Cluster:
    world_size = 3

    def __init__(self, busy):
        self.dead = {1: "killed (SIGKILL)"}
        self._busy = busy
        self.asked = []

    def status(self):
        return []

    def wait_settled(self, timeout_s):
        return list(self._busy)

    def call(self, *a, **k):
        self.asked.append(a)
        raise AssertionError("a busy survivor must not be asked")


def test_a_survivor_still_busy_is_not_asked_and_the_reason_is_said():
    c = _Cluster(busy=[0])
    src, why, steps = replica.source(c, hard=False)
    assert src is None and steps == {} and not c.asked
    assert why == "rank 0 still busy 30 s after a peer died"


def test_a_hard_restart_and_a_settled_cluster_are_told_apart():
    assert replica.source(_Cluster(busy=[0]), hard=True)[1] == "--hard replaces every engine"
