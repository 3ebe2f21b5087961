"""One cluster's world as one immutable value: which engine is which rank, the
group's port and generation, the side doors.

The parts of the runtime -- the transport that sends to an engine by its rank,
the group that forms on a port and counts generations, the processes that
guard the ranks' PIDs -- all read the same world.  None holds a list of its
own that the others mutate: every change (a start, a restart's replacements,
a resize, a re-formed group, the doors the ranks open) makes a new
:class:`World` and puts it in the one :class:`WorldRef` they share, so a part
reading the world mid-change sees the old one or the new one, never half of
each.  What can change between two cells without a new world -- deaths, busy
marks, whether the group is usable -- is :class:`~dpnb.cluster.types.Health`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .types import RankInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """The ranks (``ranks[r]`` is rank ``r``), the group's store port (0 until
    rank 0 first opened it) and generation (how many times the group was
    formed), and each rank's side door (``rank -> (address, port)``), read-only."""

    ranks: tuple[RankInfo, ...] = ()
    master_port: int = 0
    generation: int = 1
    doors: Mapping[int, tuple[str, int]] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "doors", MappingProxyType(dict(self.doors)))

    @property
    def size(self) -> int:
        return len(self.ranks)

    def with_ranks(self, ranks: Iterable[RankInfo], fresh: Iterable[int] = ()) -> World:
        """A new rank table: ``fresh`` ranks (new engines) and ranks past its end
        lose their doors; the group's port and generation stay."""
        ranks = tuple(ranks)
        fresh = set(fresh)
        doors = {r: a for r, a in self.doors.items() if r not in fresh and r < len(ranks)}
        return dataclasses.replace(self, ranks=ranks, doors=doors)

    def with_doors(self, opened: Mapping[int, tuple[str, int]]) -> World:
        """The doors the ranks answered ``init_rank`` with, beside the others."""
        return dataclasses.replace(self, doors={**self.doors, **opened})

    def formed(self, port: int, generation: int | None = None) -> World:
        """The group formed (again) on ``port``; its generation as the ranks counted it."""
        return dataclasses.replace(self, master_port=int(port),
                                   generation=self.generation if generation is None
                                   else int(generation))

    # ------------------------------------------------------------------ record
    def to_record(self) -> dict:
        """The world as JSON (for a kept cluster's record, :mod:`.keep`)."""
        return {"ranks": [dataclasses.asdict(r) for r in self.ranks],
                "master_port": self.master_port, "generation": self.generation,
                "doors": {str(r): list(a) for r, a in self.doors.items()}}

    @classmethod
    def from_record(cls, rec: dict) -> World:
        return cls(ranks=tuple(RankInfo(**r) for r in rec["ranks"]),
                   master_port=int(rec["master_port"]), generation=int(rec["generation"]),
                   doors={int(r): (a[0], int(a[1])) for r, a in rec["doors"].items()})


class WorldRef:
    """The one place the current :class:`World` lives; the parts share this, not a list.

    ``now`` is only ever replaced whole (:meth:`set`), never changed in place.
    """

    def __init__(self, world: World):
        self.now = world

    def set(self, world: World) -> World:
        if not isinstance(world, World):
            raise TypeError(f"a world is a dpnb.cluster.worldref.World, not {type(world).__name__}")
        log.debug("world: %d ranks, port %s, generation %s", world.size, world.master_port,
                  world.generation)
        self.now = world
        return world
