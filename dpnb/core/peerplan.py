"""The peer copies' plan, pure: the interval a user asks for, which rank holds
each rank's copy, and the line ``%dp memory`` shows.

Under ZeRO-1/2/3 each rank's shard lives on that rank only; every K steps it
is copied into the CPU memory of one other rank, its *holder*
(:mod:`dpnb.engine.train.peercopy`).  A rank and its holder dying together lose the
shard (the session falls back to a disk checkpoint), so on several hosts the
holder is on another host when that is possible: a whole host lost is
survivable.  Each rank holds exactly one copy (the holders are a permutation
of the ranks), so the memory per rank stays one shard and the exchange is one
send and one receive per rank.
"""

from __future__ import annotations

from .errors import ConfigError

OFF_WORDS = ("off", "none", "no")
#: the copies' interval when the user gave none, under the strategies that shard
DEFAULT_EVERY = 10
#: the strategies whose state lives on one rank only: copies on by default
SHARDED = ("zero1", "zero2", "zero3")


def every_in_force(asked: int | None, strategy: str) -> int:
    """The interval the ranks use (0: off): what the user asked, else the default."""
    if asked is not None:
        return asked
    return DEFAULT_EVERY if strategy in SHARDED else 0


def parse_every(value) -> int:
    """``--peer-copy-every K``: a whole number of steps >= 1, or ``0`` / ``off``
    (no copies).  An int is taken as it is; a string as the magic passes it."""
    got = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in OFF_WORDS:
            return 0
        value = int(text) if text.isdigit() else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"--peer-copy-every takes a whole number of steps (10 is the default "
                          f"under zero1/2/3), or off (got {got!r})")
    return value


def holders(hosts: list) -> list[int]:
    """``holders(hosts)[r]``: the rank that keeps rank ``r``'s copy, given each
    rank's host.

    The ranks are listed host by host, the host with the most ranks first
    (ties: the host seen first), and each rank's holder is the one ``a``
    places further on, ``a`` being that largest host's rank count: no holder
    is on its own rank's host unless one host holds more than half the ranks,
    and then only the fewest possible (``2a - n``; each rank holds one copy).
    On one host (or one rank per host, in rank order) it is rank ``r + 1``.
    """
    n = len(hosts)
    if n < 2:
        return list(range(n))
    by_host: dict = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    groups = sorted(by_host.values(), key=lambda m: (-len(m), m[0]))
    order = [r for m in groups for r in m]
    shift = len(groups[0]) if len(groups) > 1 else 1
    out = [0] * n
    for i, r in enumerate(order):
        out[r] = order[(i + shift) % n]
    return out


def memory_line(every: int | None, nbytes: list[int], strategy: str) -> str:
    """One line: the interval in force and each rank's CPU bytes for the copies."""
    if not every:
        why = ("ddp rebuilds a rank from a survivor's replica" if strategy == "ddp"
               else "a death falls back to the disk checkpoint")
        return f"peer copies: off ({why})"
    mb = [b / 2**20 for b in nbytes]
    each = ", ".join(f"rank {r} {m:.1f} MB" for r, m in enumerate(mb))
    return (f"peer copies every {every} steps: {max(mb):.1f} MB of CPU memory per rank at most "
            f"({each}: own snapshot, the neighbour's copy, the next copy's buffers)")


def placement_line(held_by: list[int] | None, hosts: list[str]) -> str | None:
    """Where each rank's copy is kept (``held_by[r]``: the holder of rank ``r``'s
    copy; ``hosts[r]``: rank ``r``'s host), and what losing a host would cost:
    a copy on its owner's host is lost with that host.  None without holders."""
    if not held_by or len(held_by) != len(hosts):
        return None
    where = ", ".join(f"{r}->{h}" for r, h in enumerate(held_by))
    same = [r for r, h in enumerate(held_by) if hosts[h] == hosts[r]]
    if len(set(hosts)) < 2:
        why = "one host: a rank lost is rebuilt from its holder's copy; the host lost, from disk"
    elif not same:
        why = "every copy on another host than its owner's: a whole host lost is rebuilt"
    else:
        many = len(same) > 1
        why = (f"rank{'s' if many else ''} {', '.join(map(str, same))} "
               f"{'have their copies' if many else 'has its copy'} on the owner's own host (more "
               f"than half the ranks are on one host): losing that host loses "
               f"{'those shards' if many else 'that shard'}")
    return f"copies held (rank->holder): {where}; {why}"

