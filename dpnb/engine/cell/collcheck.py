"""Checking that every rank calls the same collective, before gloo/NCCL sees it.

gloo aborts the whole engine (SIGABRT) when two ranks join one collective with
tensors of different sizes, and hangs or mixes data up when their ops differ:
a typo, or an uneven last batch, would cost an engine and everything on it.
So a collective that code in a ``%%dp`` cell calls on the default group first
compares a *fingerprint* -- op, tensor shapes and dtypes, root, reduce op --
across the ranks, and only runs when they all agree.  On a mismatch every rank
raises :class:`CollectiveMismatchError`, which names each rank's call, and
none of them has touched the process group: nothing needs re-forming.

The comparison travels on its own small *star* of TCP connections (rank 0
the hub, one connection per other rank), formed with every (re-)formation of
the group and authenticated with the cluster's token.  It is not a gloo
collective: a second gloo group or a debug wrapper around the real one costs
several thread hand-offs per call (a checked 1-float all_reduce took 2.5 ms
against 0.3 ms) and, as the default group, segfaulted the DDP that a user
built on it.  Here a check is one 16-byte message to the hub and an 8-byte
verdict back; the real collective then runs on the real group, so every
object a library builds in a cell (DDP, FSDP, ZeRO, Accelerate) holds the
real group.

Who communicates what: every rank sends ``(seq, digest)`` -- the number of
this check since the group formed and a 64-bit hash of its fingerprint --
to the hub; the hub compares them with its own and answers 0 (all equal) or 1
to each.  After a 1 every rank sends its readable fingerprint and gets back
the table of all of them, so all ranks raise the same error.  A release
(:mod:`dpnb.engine.sidedoor`) shuts these connections like the group's own,
so a rank waiting here for a peer is freed as fast as one inside gloo.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
from typing import Any

from dpnb.core.cellflags import UNCHECKED_FLAG, trailing_flags
from dpnb.engine.debugging.frames import is_cell

#: what identifies a call, per collective: (parameter, kind); kinds: ``t`` a
#: tensor (shape, dtype), ``tl`` a list of tensors, ``n`` a list's length, ``v``
#: a plain value.  Lists that only the root passes (gather_list, scatter_list)
#: are left out: they legitimately differ.  Shapes of all_to_all lists may
#: differ by design, so only their lengths and dtypes count.
SPECS: dict[str, tuple[tuple[str, str], ...]] = {
    "all_reduce": (("tensor", "t"), ("op", "v")),
    "broadcast": (("tensor", "t"), ("src", "v"), ("group_src", "v")),
    "all_gather": (("tensor_list", "tl"), ("tensor", "t")),
    "all_gather_into_tensor": (("output_tensor", "t"), ("input_tensor", "t")),
    "all_gather_single": (("output_tensor", "t"), ("input_tensor", "t")),
    "all_gather_object": (("object_list", "n"),),
    "reduce_scatter": (("output", "t"), ("input_list", "tl"), ("op", "v")),
    "reduce_scatter_tensor": (("output", "t"), ("input", "t"), ("op", "v")),
    "reduce_scatter_single": (("output", "t"), ("input", "t"), ("op", "v")),
    "reduce": (("tensor", "t"), ("dst", "v"), ("op", "v"), ("group_dst", "v")),
    "gather": (("tensor", "t"), ("dst", "v"), ("group_dst", "v")),
    "scatter": (("tensor", "t"), ("src", "v"), ("group_src", "v")),
    "barrier": (),
    "monitored_barrier": (),
    "all_to_all": (("output_tensor_list", "n"), ("input_tensor_list", "n"),
                   ("input_tensor_list", "d")),
    "all_to_all_single": (("output", "d"), ("input", "d"), ("output_split_sizes", "v"),
                          ("input_split_sizes", "v")),
    "broadcast_object_list": (("object_list", "n"), ("src", "v"), ("group_src", "v")),
    "gather_object": (("dst", "v"), ("group_dst", "v")),
    "scatter_object_list": (("scatter_object_output_list", "n"), ("src", "v"),
                            ("group_src", "v")),
}

#: point-to-point calls: counted for ``%dp where``; their sizes are checked
#: between the two ranks by :mod:`dpnb.engine.cell.p2pcheck`, not on the star
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})
#: how a call site's file is named when it is a cell
CELL = "<cell>"
#: what marks a note line on a rank's stderr (the notebook shows it once, after the cell)
NOTE_PREFIX = "[dpnb note] "
#: a note line that is a moved call's record (JSON), not a sentence: the notebook
#: compares the ranks' records and says something only when they differ
MOVED_PREFIX = "moved-call "
#: every torch.distributed function the cell guard wraps
COLLECTIVES = frozenset(SPECS) | POINT_TO_POINT
#: the device waits a rank blocks in with a GPU (torch's and dpnb's own):
#: under NCCL a rank whose peer never joins an all-reduce sits in one of
#: these, not in a c10d frame -- the collective was only queued on the stream
DEVICE_WAITS = frozenset({"synchronize", "wait_stream", "wait_event"})
#: how ``%dp where`` names such a wait, in place of a collective's name
DEVICE_WAIT_OP = "device synchronize"


class CollectiveMismatchError(RuntimeError):
    """The ranks called different collectives; none of them ran.  ``table``:
    rank -> ``{"call": text, "at": user line, "check": n}``."""

    def __init__(self, op: str, table: dict[int, dict]):
        self.table = table
        seqs = {row.get("check") for row in table.values()}

        def row(r: int) -> str:
            t = table[r]
            out = f"rank {r}: {t.get('call')}"
            if len(seqs) > 1:  # out of step: one rank is further along than another
                out += f" (its check #{t.get('check')} in this group)"
            return out + (f" at {t['at']}" if t.get("at") else "")

        rows = "; ".join(row(r) for r in sorted(table))
        self.op = op
        super().__init__(f"the ranks called different collectives (op, shape, dtype or root "
                         f"differ), so none ran: {rows}. Every engine and its state are kept.")


class CheckReleased(RuntimeError):
    """The check's connections were shut while this rank waited (a release)."""


# ------------------------------------------------------------- fingerprints
def _tensor(t: Any) -> str:
    shape = getattr(t, "shape", None)
    if shape is None:
        return type(t).__name__
    dev = getattr(getattr(t, "device", None), "type", "cpu")
    s = f"{list(shape)} {str(t.dtype).removeprefix('torch.')}"
    return s if dev == "cpu" else f"{s} on {dev}"


def _value(v: Any) -> str:
    name = getattr(v, "name", None)  # ReduceOp / RedOpType members
    return name if isinstance(name, str) else repr(v)


def describe(op: str, bound: dict) -> str:
    """``all_reduce [4] float32 op=SUM``: one call as text, from its bound arguments."""
    parts = [op]
    for pname, kind in SPECS.get(op, ()):
        v = bound.get(pname)
        if kind == "t":
            parts.append(_tensor(v))
        elif kind == "tl":
            parts.append("[" + ", ".join(_tensor(x) for x in (v or ())) + "]")
        elif kind == "n":
            parts.append(f"{pname}: {len(v) if v is not None else 0} items")
        elif kind == "d":
            dts = {str(x.dtype).removeprefix("torch.") for x in (v if isinstance(v, (list, tuple))
                                                                else [v]) if hasattr(x, "dtype")}
            parts.append("/".join(sorted(dts)) or "-")
        elif v is not None and not (pname == "op" and _value(v) == "SUM"):
            parts.append(f"{pname}={_value(v)}")
    return " ".join(parts)


def digest(text: str) -> int:
    """A 64-bit hash of a fingerprint that is the same in every process
    (Python's ``hash`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def is_unchecked(info) -> bool:
    """Does the cell IPython is about to run carry the ``--unchecked`` flag?  It
    travels in the cell's own request (:mod:`dpnb.core.cellflags`: IPython hands
    the raw cell to ``pre_run_cell``), no round trip before it."""
    return UNCHECKED_FLAG in trailing_flags(getattr(info, "raw_cell", None))


# ----------------------------------------------------------------- patterns
class Pattern:
    """Which calls need a check: the repeat of an agreed period does not.

    A hand-written loop calls the same collectives in the same order every
    iteration (a reduce-scatter then an all-gather; one all_reduce per
    parameter).  Every check also carries this rank's *proposal*: the
    shortest period its history of calls (this one included) has shown
    twice in a row -- calls *and their sites*, so a loop whose lines move
    (``if i % 2``) keeps being checked.  The hub agrees on a period only when
    every rank proposes the same one (otherwise none: every call is checked),
    and says which; while a rank's next call is the one a period earlier it
    runs without a check.

    Why that is safe: the last check before such a call was made by every
    rank (had some ranks checked and others not, the checkers would still be
    waiting on the star, never posting the collective -- a deadlock the
    notebook releases, not an abort), so every rank holds the same agreed
    period and, by induction, the same history of calls; a call equal to the
    one a period earlier is then equal on every rank.  A rank whose call
    differs from its period checks, and no rank's mismatched tensor ever
    reaches gloo.  Sites never decide whether a call is checked (they
    legitimately differ between ranks): a skipped call whose site is not the
    one a period earlier is only noted (:meth:`moved`).  The history starts
    afresh with every cell.
    """

    MAX_PERIOD = 256

    def __init__(self) -> None:
        self.hist: collections.deque = collections.deque(maxlen=2 * self.MAX_PERIOD)
        self.sites: collections.deque = collections.deque(maxlen=2 * self.MAX_PERIOD)
        self.period = 0

    def reset(self) -> None:
        self.hist.clear()
        self.sites.clear()
        self.period = 0

    def repeats(self, d: int) -> bool:
        p = self.period
        return bool(p) and len(self.hist) >= p and self.hist[-p] == d

    def moved(self, site: Any) -> Any:
        """While :meth:`repeats`: the site a period earlier if ``site`` differs from it, else None."""
        before = self.sites[-self.period]
        return before if before != site else None

    def proposal(self, d: int, site: Any = None) -> int:
        """The shortest period of the history followed by ``(d, site)``, seen twice; 0 if none."""
        h = list(zip(self.hist, self.sites))
        cur = (d, site)
        h.append(cur)
        n = len(h)
        for p in range(1, min(self.MAX_PERIOD, n // 2) + 1):
            if h[n - 1 - p] == cur and all(h[n - 1 - i] == h[n - 1 - i - p] for i in range(p)):
                return p
        return 0

    def record(self, d: int, period: int | None = None, site: Any = None) -> None:
        self.hist.append(d)
        self.sites.append(site)
        if period is not None:
            self.period = period


# -------------------------------------------------------------------- sites
@functools.lru_cache(maxsize=1024)
def site_key(filename: str) -> str:
    """A call site's file as every rank names it: a cell's file name differs
    between engines (its execution count, ipykernel's per-process folder)."""
    return CELL if is_cell(filename) else filename


@functools.lru_cache(maxsize=4096)
def site_digest(site: tuple | None) -> int:
    """The 64-bit hash of a site that the check sends (the same in every process)."""
    return 0 if site is None else digest(f"{site[0]}:{site[1]}")


def site_label(site: tuple | list | None) -> str:
    """``cell line 3`` / ``train.py line 42`` for a ``(site_key, line)``."""
    if not site:
        return "an unknown line"
    name, line = site
    return f"cell line {line}" if name == CELL else f"{os.path.basename(name)} line {line}"


def pairing_notes(paired: list[dict], moved: list[dict], limit: int = 3) -> list[str]:
    """One line per distinct pairing of calls across lines, for the cell's note or report.

    ``paired``: ``{"op", "seq", "sites": {rank: label}}`` for checked calls the
    ranks made from different lines (the same on every rank: the hub sent the
    table).  ``moved``: ``{"rank", "op", "seq", "at", "before"}`` for calls this
    rank made, unchecked (they repeated the agreed loop), from another line
    than the same call a loop earlier."""
    lines, seen = [], set()
    for p in paired:
        by_site: dict[str, list[int]] = {}
        for r, at in sorted(p["sites"].items(), key=lambda kv: int(kv[0])):
            by_site.setdefault(at, []).append(int(r))
        key = (p["op"], tuple(sorted((at, tuple(rs)) for at, rs in by_site.items())))
        if key in seen:
            continue
        seen.add(key)
        groups = [(rank_text(rs), at) for at, rs in by_site.items()]
        if len(groups) == 2:
            (ra, a), (rb, b) = groups
            lines.append(f"{ra}'s {p['op']} at {a} was paired with {rb}'s {p['op']} at {b}: "
                         f"both results mix values from different lines")
        else:
            lines.append(f"{p['op']} was called from different lines ("
                         + "; ".join(f"{rs} at {at}" for rs, at in groups)
                         + "): each result mixes values from these lines")
    for m in moved:
        key = ("moved", m["rank"], m["op"], tuple(sorted((m["at"], m["before"]))))
        if key in seen:
            continue
        seen.add(key)
        lines.append(moved_record(m))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more calls paired across lines"]
    return lines


def moved_record(m: dict) -> str:
    """A moved call as the note line a rank writes: its record, for the notebook to
    compare with the other ranks' (:func:`moved_notes`)."""
    return MOVED_PREFIX + json.dumps({k: m[k] for k in ("rank", "op", "seq", "at", "before")})


def moved_notes(notes_by_rank: dict[int, list[str]]) -> list[str]:
    """The moved-call records among the ranks' notes, in words -- only where they
    differ between ranks.  A call that repeated the agreed loop from another line
    on *every* rank alike (a ``barrier`` after a loop of barriers, a library's own
    collectives after the user's) paired line with line as it should: no note.
    Where some ranks moved and others did not, or moved elsewhere, the unchecked
    call may have paired different lines: one sentence naming who called from where."""
    moves: dict[tuple, dict[int, str]] = {}
    for r, notes in notes_by_rank.items():
        for n in notes:
            if n.startswith(MOVED_PREFIX):
                m = json.loads(n[len(MOVED_PREFIX):])
                moves.setdefault((m["op"], m["seq"], m["before"]), {})[r] = m["at"]
    out = []
    ranks = sorted(notes_by_rank)
    for (op, _seq, before), at in moves.items():
        if len(at) == len(ranks) and len(set(at.values())) == 1:
            continue  # every rank's call moved alike
        where: dict[str, list[int]] = {}
        for r in ranks:
            where.setdefault(at.get(r, before), []).append(r)
        out.append(f"{op} was called from different lines on different ranks after repeating "
                   f"the agreed loop (not compared: " + "; ".join(
                       f"{rank_text(rs)} at {a}" for a, rs in where.items()) +
                   "): each result may mix values from these lines")
    return out


def rank_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
