"""Flags a cell travels with: comment lines after the user's code, no request before it.

The notebook asks something of a cell's run -- ``%%dp --unchecked``, ``%%dp
--profile`` -- by appending ``# dpnb: FLAG`` lines to the code it sends
(``Engines.run(unchecked=..., flags=...)``); each rank's ``pre_run_cell`` hook
reads them off the raw cell IPython hands it.  Comments, last: no line of the
user's moves, and a traceback's line numbers stay the notebook's.  The runtime
only carries them; what a flag means is the hook's (the cell guard's
``engine/cell/collcheck.is_unchecked`` for ``--unchecked``,
``dpnb.engine.metrics.profilemark`` for ``--profile``,
``dpnb.engine.debugging.rankdap`` for ``--dap``).
"""

from __future__ import annotations

import json
import base64
import pickle
import re
from dataclasses import dataclass

PREFIX = "# dpnb: "
#: how many trailing lines a hook looks at (the flags one cell can carry)
MAX_FLAGS = 4
_TAG = re.compile(r"[A-Za-z0-9_-]{1,80}")
#: ``%%dp --unchecked``: this cell's collectives are counted, not checked
UNCHECKED_FLAG = "--unchecked"
#: the name a profiled cell's end travels under in its reply's carry
#: (dpnb.engine.metrics.profile.end_into_reply, dpnb.session.profile)
PROFILE_CARRY = "profile"


def carry_text(value) -> str:
    """A value as the text a reply's carry holds (a reply's content is JSON)."""
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def carried_value(text: str):
    """The value :func:`carry_text` wrote (the rank's own, sent in its reply)."""
    return pickle.loads(base64.b64decode(text))


def with_flags(code: str, flags: tuple[str, ...] | list[str]) -> str:
    """``code`` with one ``# dpnb: FLAG`` line per flag after it."""
    if not flags:
        return code
    return code + ("" if code.endswith("\n") else "\n") + "".join(PREFIX + f + "\n" for f in flags)


def trailing_flags(raw: object) -> list[str]:
    """The flags among a raw cell's last :data:`MAX_FLAGS` lines (the user's own
    ``# dpnb:`` comments higher up never count)."""
    if not isinstance(raw, str) or PREFIX not in raw:
        return []
    return [ln[len(PREFIX):] for ln in raw.rstrip().splitlines()[-MAX_FLAGS:]
            if ln.startswith(PREFIX)]


def profile_flag(tag: str) -> str:
    """The flag of a profiled cell: ``--profile TAG`` (TAG names the profile's files)."""
    if not _TAG.fullmatch(tag):
        raise ValueError(f"a profile's tag is letters, digits, '-' and '_' (got {tag!r})")
    return "--profile " + tag


def profile_tag(raw: object) -> str | None:
    """The tag of the profile a raw cell asks for, or None."""
    for f in trailing_flags(raw):
        name, _, tag = f.partition(" ")
        if name == "--profile" and _TAG.fullmatch(tag):
            return tag
    return None


@dataclass(frozen=True)
class DapCell:
    """What a ``%%dp`` cell run under JupyterLab's debugger tells its ranks
    (:mod:`dpnb.engine.debugging.rankdap`): the path the notebook's debugger
    knows the cell by, the lines the rank's copy is shifted by (the ``%%dp``
    line), and every breakpoint set in the notebook, by path."""

    path: str
    shift: int
    breaks: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def points(self) -> dict[str, set[int]]:
        return {p: set(lines) for p, lines in self.breaks}


def dap_flag(cell: DapCell) -> str:
    """The flag of a cell run under the notebook's debugger: ``--dap {json}``."""
    return "--dap " + json.dumps({"path": cell.path, "shift": cell.shift,
                                  "breaks": {p: list(ls) for p, ls in cell.breaks}},
                                 separators=(",", ":"))


def dap_cell(raw: object) -> DapCell | None:
    """The debugger's request a raw cell carries, or None (a malformed one too)."""
    for f in trailing_flags(raw):
        name, _, rest = f.partition(" ")
        if name != "--dap":
            continue
        try:
            d = json.loads(rest)
            return DapCell(str(d["path"]), int(d["shift"]),
                           tuple((str(p), tuple(int(n) for n in ls))
                                 for p, ls in dict(d.get("breaks") or {}).items()))
        except (ValueError, KeyError, TypeError):
            return None
    return None
