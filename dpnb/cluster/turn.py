"""Whose turn it is on the ranks: the notebook's cells, or an agent's call.

A cluster has one driver at a time.  An engine runs one request at a time,
so two callers interleaving on it would see each other's cells queue (an
agent's ``status`` would wait behind the human's hung cell) or, worse, mix
two cells' collectives in one process group.  So every call that sends work
to the engines holds the cluster's :class:`Turn`:

* **the notebook** (``%%dp``, ``%dp ...``, ``c.run`` ...) takes it for the
  whole call; a verb made of several calls (``wrap``, ``train``) holds it
  across them (the turn is re-entrant per thread).  An agent's *brief* read
  that holds it (a status query, a few milliseconds) is waited out; an
  agent's long call (``run_code``, ``restart``) is not: the notebook's call is
  refused at once, saying what runs and how to stop it.
* **an agent** (``dpnb mcp``, through the kernel's door: :mod:`dpnb.agent.door`)
  never waits: when the notebook holds the turn, its reads answer from what
  needs no engine (the side doors, the notebook's own records) and its
  actions and code are refused, saying why.

Nothing here talks to the engines: ``where`` and ``interrupt`` use the side
doors and signals and never take the turn, so they answer while a cell hangs.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

from ..errors import DpnbError

#: the longest the notebook waits for an agent's brief read to end (they take ms)
BRIEF_WAIT_S = 10.0


class TurnTaken(DpnbError):
    """The ranks are driven by someone else now (the message says who and what to do)."""


@dataclass(frozen=True)
class Holder:
    """Who holds the turn: ``who`` in words ("the notebook", "an agent's run_code"),
    ``brief``: a read of milliseconds the notebook may wait out, ``since``: monotonic."""

    who: str
    brief: bool
    since: float

    def age_s(self) -> float:
        return time.monotonic() - self.since


class Turn:
    """The cluster's one driver at a time (re-entrant per thread)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._thread: int | None = None
        self._depth = 0
        self._holder: Holder | None = None

    @property
    def holder(self) -> Holder | None:
        """Who holds it now (None: free)."""
        return self._holder

    def try_take(self, who: str, *, brief: bool = False, wait_brief_s: float = 0.0) -> Holder | None:
        """Take the turn for this thread; ``None`` when taken, else who holds it.
        ``wait_brief_s``: how long to wait for a brief holder to finish."""
        me = threading.get_ident()
        deadline = time.monotonic() + wait_brief_s
        with self._cv:
            while self._thread not in (None, me):
                left = deadline - time.monotonic()
                if not self._holder.brief or left <= 0:
                    return self._holder
                self._cv.wait(left)
            if self._thread is None:
                self._holder = Holder(who, brief, time.monotonic())
            self._thread = me
            self._depth += 1
            return None

    def release(self) -> None:
        with self._cv:
            if self._thread != threading.get_ident():
                raise RuntimeError("the turn is released by the thread that took it")
            self._depth -= 1
            if self._depth == 0:
                self._thread, self._holder = None, None
                self._cv.notify_all()

    def take_for_notebook(self) -> None:
        """The notebook's call starts: wait out an agent's brief read, else refuse."""
        h = self.try_take("the notebook", wait_brief_s=BRIEF_WAIT_S)
        if h is not None:
            raise TurnTaken(f"the ranks are running {h.who} (for {h.age_s():.0f} s), so this "
                            f"call was not sent: wait for it to end, or %dp interrupt stops it "
                            f"(%dp agent --deny refuses the agent's next actions and code)")


def notebook_turn(fn):
    """A method of a cluster that sends work to its engines: held as the notebook's turn."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        self.turn.take_for_notebook()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.turn.release()

    return call
