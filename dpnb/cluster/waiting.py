"""The clock of one wait for a cell or call: when to release, interrupt, or give up.

:meth:`dpnb.cluster.transport.Transport.wait` collects the ranks' answers;
this decides, on each wake-up, what the ranks still running need: a release
of their groups after a peer failed (they wait for it in a collective), an
interrupt at the cell's timeout or on Ctrl-C, a release of a certain deadlock
(:mod:`dpnb.cluster.deadlock`), and when to stop waiting.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from ..core.timeouts import form_timeout
from . import deadlock
from .diagnose import WAITS_FOR_BUSY, where_report
from .types import RankOutcome, Status, WaitKind

if TYPE_CHECKING:
    from .transport import Transport

log = logging.getLogger(__name__)

#: after a rank failed while others still run: how long to let them fail on
#: their own (a typo fails on every rank within milliseconds) before releasing
FAIL_GRACE_S = 0.1
#: after an interrupt (timeout, Ctrl-C): how long ranks may take to stop by
#: themselves before their groups are released (cells / dpnb calls such as
#: %dp train, which stop at a step boundary)
RELEASE_AFTER_S = {WaitKind.EXECUTE: 0.3, WaitKind.APPLY: 2.0, WaitKind.VALUE: 2.0}
#: after a release, how long the ranks get to report back
RELEASED_GRACE_S = 5.0
#: ... and longer when every rank left is writing its error report (seen
#: taking seconds with 3 engines on 2 busy cores)
REPORT_GRACE_S = 20.0
#: after a cell failed on some ranks: while every rank left is outside the
#: cell's code and no collective (finishing its own error report, or not yet
#: started), re-ask where they are this often instead of releasing the group,
#: for at most FINISHING_MAX_S; releasing costs a re-formation (0.2 s at 16
#: ranks) that a cell failing everywhere alike does not need
FINISHING_POLL_S = 0.15
FINISHING_MAX_S = 5.0
#: how often a waiting cell checks whether a pending rank's process died
DEATH_POLL_S = 0.1
#: once some ranks finished and others still run: after this long, ask the
#: running ones where they are, this often, for a certain deadlock (a
#: collective a finished rank can never join); two looks alike release it.
#: At 32 ranks on 2 cores a plain cell's ranks finish up to ~0.1 s apart: the
#: first look waits past that, so ordinary cells are never asked anything
DEADLOCK_FIRST_S = 0.25
DEADLOCK_POLL_S = 0.1
#: while every rank still runs a cell: look this often (a rank checking a call
#: that a peer ran unchecked; see dpnb.cluster.deadlock), from this long on;
#: a long cell (past DEADLOCK_SLOW_AFTER_S) is looked at less often
DEADLOCK_ALL_RUNNING_FIRST_S = 0.2
DEADLOCK_ALL_RUNNING_S = 0.5
DEADLOCK_SLOW_AFTER_S = 5.0
DEADLOCK_SLOW_S = 2.0
#: a cell whose ranks have been in "some blocked in a collective, others still
#: running their code" this long gets one line saying who waits for whom
#: (shown while it runs; a wait is never released, it lasts up to the group
#: timeout, torch's 30 minutes by default)
WAIT_NOTE_AFTER_S = 10.0
#: how often a wait asks whether a pending rank's process is frozen (stopped by
#: SIGSTOP, held by a debugger): a read of /proc/PID/stat here, one line to the
#: host's agent for a rank on another host; a cell done sooner is never asked
FROZEN_POLL_S = 0.25
#: frozen this long (stopped at every look meanwhile, five at least) before its
#: peers are released: a process stopped and continued (job control, a
#: profiler's sample) is not a frozen rank.  Each second here is a second of
#: every peer's time when a rank is frozen for good (the storm benchmark's
#: freezes cost 5.0 s at 2 s and one look a second, benchmarks/RESULTS.md)
FROZEN_AFTER_S = 1.0


class Waiting:
    """The state of one :meth:`Transport.wait`: what is pending, and when to act."""

    def __init__(self, t: "Transport", sel: list[int], kind: WaitKind, timeout,
                 say: Callable[[str], None] | None = None):
        self.t, self.kind, self.timeout = t, kind, timeout
        self.say = say  # a line to the notebook while the cell runs (None: headless)
        self.wait_noted = False
        self.t0 = time.monotonic()
        self.outcomes = {r: RankOutcome(rank=r) for r in sel}
        self.pending = set(sel)
        self.interrupted_at: float | None = None
        self.failed_at: float | None = None
        self.released = False
        self.released_at: float | None = None
        self.where: dict = {}
        self.presses = 0
        self.asked_at: float | None = None
        self.finishing = False
        self.deaths_looked_at = self.t0  # a cell done within DEATH_POLL_S never asks
        self.first_done_at: float | None = None
        self.deadlock_looked_at = 0.0
        self.deadlock_seen: tuple | None = None  # the last look's blocked calls
        self.paused = 0.0  # seconds spent at pdb prompts: the cell timeout skips them
        self.prompted_at: float | None = None
        self.frozen_looked_at = self.t0
        self.frozen_since: dict[int, float] = {}  # rank -> when it was first seen stopped
        self.frozen: set[int] = set()  # named frozen: no side door is knocked on

    def prompted(self, spent: float) -> bool:
        """Note time spent answering a pdb prompt; True if one was answered."""
        if not spent:
            return False
        self.paused += spent
        self.prompted_at = time.monotonic()
        return True

    def time_to_look_for_deaths(self, now: float) -> bool:
        """Every DEATH_POLL_S, the first time DEATH_POLL_S into the wait: the
        wait loop wakes at each reply (32 per cell at 32 ranks), and asking
        each pending rank's process every time cost 5 ms per cell there; the
        one look at the first wake-up still cost ~0.4 ms of a 30 ms cell at
        16 ranks (cProfile, issue 45)."""
        if now - self.deaths_looked_at < DEATH_POLL_S:
            return False
        self.deaths_looked_at = now
        return True

    def _stopped(self) -> set[int]:
        """Ranks seen stopped (named frozen or not yet): a stopped process answers no
        side door, and a knock on it would hold this wait for the knock's timeout."""
        return self.frozen | set(self.frozen_since)

    def _answering(self) -> list[int]:
        """Every rank but the stopped ones."""
        return [r for r in range(len(self.t.ranks)) if r not in self._stopped()]

    def _capture_where(self) -> None:
        """Ask every rank where it is, once, before anything is interrupted."""
        if not self.where:
            answers = self.t.where(self._answering())
            self.where = {r: dict(a, running=r in self.pending, selected=r in self.outcomes)
                          for r, a in answers.items() if a}
            # the report's culprits rest on these answers: keep them for a post-mortem
            log.info("where, before acting (pending %s): %s", sorted(self.pending),
                     {r: (a or {}).get("collective") or ("reporting its error" if (a or {}).get("reporting")
                                                         else (a or {}).get("top"))
                      for r, a in answers.items()})

    def _release(self, now: float) -> None:
        if self.released:
            return
        self._capture_where()
        # every rank, idle ones too: closing their side is what frees a peer
        self.released = self.t.release(self._answering())
        self.released_at = now

    def _interrupt(self, now: float, status: Status) -> None:
        """SIGINT the pending ranks.  At a cell timeout the culprits are the
        ranks running Python code; those waiting inside a collective for them
        are waiters (unless every pending rank is in a collective)."""
        self._capture_where()
        # a rank already writing its error report finishes by itself: an
        # interrupt would only replace its real error by KeyboardInterrupt
        reporting = self._reporting()
        marked = set(self.pending) - reporting - self.frozen
        if status == Status.TIMEOUT:
            inside = {r for r in self.pending if (self.where.get(r) or {}).get("collective")}
            if inside != marked:
                marked -= inside
        for r in marked:
            self.outcomes[r].status = status
        self.t.interrupt(self.pending - reporting - self.frozen)
        self.interrupted_at = now

    def _only_finishing(self, now: float) -> bool:
        """True while no rank still pending can block a peer or be blocked.

        A cell that raises on every rank reaches the notebook rank by rank (on
        a loaded host, IPython formats each traceback for a while).  Those
        ranks have left the cell's code and hold no collective: releasing the
        group for them would only cost a re-formation.  A pending rank inside
        the cell's code or a collective may wait on the failed ones: release
        as before.  ``apply`` calls (dpnb's own functions) are not told apart
        this way, and release at once."""
        if self.kind != WaitKind.EXECUTE or now - self.failed_at > FINISHING_MAX_S:
            return False
        if self.asked_at is not None and now - self.asked_at < FINISHING_POLL_S:
            return self.finishing
        self.asked_at = now
        answers = self.t.where(sorted(self.pending - self._stopped()))
        self.finishing = all(
            a and not a.get("collective") and (a.get("reporting") or not a.get("in_cell"))
            for a in (answers.get(r) for r in self.pending))
        return self.finishing

    def _reporting(self) -> set[int]:
        return {r for r in self.pending if (self.where.get(r) or {}).get("reporting")}

    def _deadlocked(self, now: float) -> bool:
        """True when every rank still running waits for good (two looks alike)."""
        everyone = len(self.pending) == len(self.outcomes) == len(self.t.ranks)
        if everyone:  # nobody has finished, and every rank runs the cell
            ran = now - self.t0 - self.paused
            every = DEADLOCK_POLL_S if self.deadlock_seen else (
                DEADLOCK_ALL_RUNNING_S if ran < DEADLOCK_SLOW_AFTER_S else DEADLOCK_SLOW_S)
            if self.kind != WaitKind.EXECUTE or ran < DEADLOCK_ALL_RUNNING_FIRST_S \
                    or now - self.deadlock_looked_at < every:
                return False
        else:
            if self.first_done_at is None:
                self.first_done_at = now
            if now - self.first_done_at < DEADLOCK_FIRST_S or \
                    now - self.deadlock_looked_at < DEADLOCK_POLL_S:
                return False
        self.deadlock_looked_at = now
        answers = self.t.where(sorted(self.pending - self._stopped()))
        why = deadlock.certain(answers, self.pending, len(self.t.ranks))
        if not why:
            self._note_wait(now, answers)
        sig = deadlock.signature(answers, self.pending) if why else None
        stable, self.deadlock_seen = sig is not None and sig == self.deadlock_seen, sig
        if stable:
            log.info("certain deadlock, releasing: %s", why)
            for r in self.pending:
                self.outcomes[r].status, self.outcomes[r].note = Status.DEADLOCKED, why[r]
        return stable

    def _note_wait(self, now: float, answers: dict) -> None:
        """Once per cell, past WAIT_NOTE_AFTER_S: "rank 1 is blocked in barrier
        ..., waiting for rank 0, still running its code (a wait, not a deadlock)"."""
        ran = now - self.t0 - self.paused
        if self.say is None or self.wait_noted or ran < WAIT_NOTE_AFTER_S:
            return
        verdict = where_report(sorted(self.pending), answers, busy=set(self.pending), dead={})
        if WAITS_FOR_BUSY in verdict:
            self.wait_noted = True
            self.say(f"dpnb ({ran:.0f} s): {verdict}")

    def _look_for_frozen(self, now: float) -> bool:
        """Every FROZEN_POLL_S: name the pending ranks frozen for FROZEN_AFTER_S
        (their outcome says how); True when one was newly named."""
        if now - self.frozen_looked_at < FROZEN_POLL_S:
            return False
        self.frozen_looked_at = now
        found = self.t.frozen(sorted(self.pending - self.frozen))
        for r in list(self.frozen_since):
            if r not in found:  # continued: it runs again
                del self.frozen_since[r]
        newly = []
        for r, how in found.items():
            if now - self.frozen_since.setdefault(r, now) >= FROZEN_AFTER_S:
                self.outcomes[r].status, self.outcomes[r].note = Status.FROZEN, how
                self.frozen.add(r)
                newly.append(r)
        for r in newly:
            log.warning("rank %s frozen: %s", r, self.outcomes[r].note)
            if self.say is not None:
                self.say(f"dpnb: rank {r} is frozen: {self.outcomes[r].note}; it runs no code, "
                         f"so its peers are released instead of waiting for the group timeout")
        return bool(newly)

    def step(self, now: float) -> bool:
        """Act on the clock; True to stop waiting."""
        if not self.pending:
            return False
        if self._look_for_frozen(now):
            # its peers wait for it in a collective, or will: free them now
            self._release(now)
        if self.failed_at is None and any(o.status in (Status.ERROR, Status.DIED)
                                          for o in self.outcomes.values()):
            self.failed_at = now
        if self.failed_at is None and self.interrupted_at is None and not self.released \
                and self._deadlocked(now):
            self._release(now)
        if self.failed_at is not None and now - self.failed_at > FAIL_GRACE_S \
                and not self.released and not self._only_finishing(now):
            # the others wait for the failed rank in a collective, or will:
            # free them, and stop the ones still in Python code.  If every
            # failure so far is a collective one, the ranks still running are
            # those that never arrived: they are the culprits, not victims.
            failed = [o for o in self.outcomes.values() if o.status in (Status.ERROR, Status.DIED)]
            waited = all(o.status == Status.ERROR and o.collective for o in failed)
            self._release(now)
            # ranks inside a collective now fail by themselves (released): waiters;
            # a rank in pdb is the user's to continue, never interrupted
            inside = {r for r, a in self.where.items() if a.get("collective") or a.get("debugger")} \
                | self._reporting() | self.frozen
            rest = [r for r in self.pending if r not in inside]
            for r in rest:  # "late": a culprit unless it turns out to have been waiting too
                self.outcomes[r].status = Status.LATE if waited else Status.STOPPED
            self.t.interrupt(rest)
        if self.timeout and self.interrupted_at is None and \
                now - self.t0 - self.paused > self.timeout:
            self._interrupt(now, Status.TIMEOUT)
        if self.interrupted_at is not None and now - self.interrupted_at > RELEASE_AFTER_S[self.kind]:
            self._release(now)
        if self.released_at is not None:
            if self.pending <= self.frozen:  # only frozen ranks left: none of them can answer
                return True
            # ranks still writing their error report will finish: wait longer for them
            grace = RELEASED_GRACE_S + (REPORT_GRACE_S if self.pending <= self._reporting() else 0.0)
            since = max(self.released_at, self.prompted_at or 0.0)  # a debugged rank: its pace
            return now - since > grace
        # interrupted and never released (no side door answered): a collective
        # may hold a rank until the group timeout; stop waiting well before a
        # 30-minute one, and leave the rank marked busy
        return (self.interrupted_at is not None
                and now - self.interrupted_at > form_timeout(self.t.timeout_s) + 10.0)

    def ctrl_c(self, now: float) -> bool:
        """Ctrl-C: interrupt; a second one releases; a third stops waiting."""
        self.presses += 1
        if self.presses == 1:
            self._interrupt(now, Status.INTERRUPTED)
            return False
        if self.presses == 2 and not self.released:
            self._release(now)
            return False
        return True
