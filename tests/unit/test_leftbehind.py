"""A rank its group's break left behind is released once more, once per break
(dpnb.cluster.leftbehind), never a frozen or dead one."""

from dpnb.cluster.leftbehind import release_left_behind
from dpnb.cluster.types import Health


class _Transport:
    def __init__(self, frozen=()):
        self.released_again: set[int] = set()
        self.asked: list[list[int]] = []
        self._frozen = set(frozen)

    def frozen(self, ranks):
        return {r: "stopped" for r in ranks if r in self._frozen}

    def release(self, ranks):
        self.asked.append(list(ranks))
        return True


def test_busy_ranks_are_released_once_per_break_never_frozen_or_dead_ones():
    h, t = Health(), _Transport(frozen=[2])
    for r in (1, 2, 3):
        h.still_busy(r)
    assert release_left_behind(t, h) == [] and t.asked == []  # the group stands: nothing
    h.group_broken("released")
    h.died(3, "killed")
    assert release_left_behind(t, h) == [1] and t.asked == [[1]]
    assert release_left_behind(t, h) == [] and t.asked == [[1]]  # once per break
    h.group_formed()
    assert release_left_behind(t, h) == [] and t.released_again == set()  # forgotten
    h.group_broken("again")
    assert release_left_behind(t, h) == [1] and t.asked == [[1], [1]]
