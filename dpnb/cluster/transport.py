"""Sending work to the engines and waiting for every rank's answer.

notebook <-> engines is ipyparallel (ZeroMQ through the controller): cells as
source, engine functions *by dotted name* (never a pickled closure), values
pushed and pulled, output streamed.  This channel is independent of
torch.distributed, so it keeps working while a collective hangs: the wait
loop here watches for results, engine deaths, the cell timeout and Ctrl-C at
once, and interrupts the ranks still running when it has to.
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..compat import result_metadata
from .diagnose import is_collective_error
from .processes import Processes
from .render import Streamer
from .sidedoor import is_closed, knock_all
from .types import CellResult, Health, RankInfo, RankOutcome

log = logging.getLogger("dpnb.transport")

#: after a rank failed while others still run: how long to let them fail on
#: their own (a typo fails on every rank within milliseconds) before releasing
FAIL_GRACE_S = 0.1
#: after an interrupt (timeout, Ctrl-C): how long ranks may take to stop by
#: themselves before their groups are released (cells / dpnb calls such as
#: %dp train, which stop at a step boundary)
RELEASE_AFTER_S = {"execute": 0.3, "apply": 2.0}
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


def _setup_fn(name: str):
    from ..engine import setup

    return getattr(setup, name)


def _runner_fn(name: str):
    from ..engine import runner

    return getattr(runner, name)


class Transport:
    """One cluster's channel to its engines; shares ``ranks`` and ``health`` with it."""

    def __init__(self, client, ranks: list[RankInfo], health: Health, procs: Processes,
                 timeout_s: float):
        self.client = client
        self.ranks = ranks  # the cluster's list, updated in place when engines are replaced
        self.health = health
        self.procs = procs
        self.timeout_s = timeout_s
        self._views: dict[int, Any] = {}  # engine id -> its DirectView
        self.token = secrets.token_hex(16)  # opens the engines' side doors
        self.doors: dict[int, tuple[str, int]] = {}  # rank -> side door address

    # ---------------------------------------------------------------- views
    def view(self, rank: int):
        """The single-engine view of ``rank``'s engine, made once per engine:
        building a DirectView costs more than sending a short cell."""
        eid = self.ranks[rank].engine_id
        v = self._views.get(eid)
        if v is None:
            v = self._views[eid] = self.client[eid]
        return v

    # ---------------------------------------------------------------- sending
    def execute(self, code: str, sel: list[int]) -> dict:
        return {r: self.view(r).execute(code, silent=False, block=False) for r in sel}

    def apply(self, fn, args: tuple, sel: list[int], per_rank: dict | None = None) -> dict:
        """``fn(*args)`` on every rank of ``sel`` (``per_rank[r]`` replaces ``args``)."""
        return {r: self.view(r).apply_async(fn, *(per_rank[r] if per_rank else args))
                for r in sel}

    def call_async(self, dotted: str, args: tuple, kwargs: dict, sel: list[int]) -> dict:
        return {r: self.view(r).apply_async(_runner_fn("call"), dotted, tuple(args), dict(kwargs))
                for r in sel}

    def setup_all(self, name: str, args: tuple = (), *, timeout=None,
                  per_rank: dict | None = None) -> CellResult:
        """:mod:`dpnb.engine.setup` function ``name`` on every rank, all sent before any wait."""
        sel = list(range(len(self.ranks)))
        ars = self.apply(_setup_fn(name), args, sel, per_rank)
        return self.wait(ars, sel, timeout=timeout, stream=False, kind="apply")

    def setup_one(self, rank: int, name: str, *args, timeout: float = 60.0):
        return self.view(rank).apply_async(_setup_fn(name), *args).get(timeout=timeout)

    # ---------------------------------------------------------------- waiting
    def wait(self, ars: dict, sel: list[int], *, timeout, stream: bool, kind: str,
             on_poll: Callable[[dict], None] | None = None) -> CellResult:
        """Wait for every rank, watching for failures, deaths, timeouts and Ctrl-C.

        A rank blocked in a gloo collective ignores SIGINT and waits for its
        peers until the group timeout.  So when a rank fails while others
        still run, or the cell times out, or Ctrl-C comes, and ranks are still
        running a moment later, the notebook *releases* the ranks' process
        groups through their side doors: every blocked collective fails at
        once, and the group is re-formed afterwards (state kept).  Where the
        stopped ranks were is asked first, for the report.
        """
        w = _Waiting(self, sel, kind, timeout)
        streamer = Streamer(ars, delay_s=1.0) if stream else None
        try:
            while w.pending:
                try:
                    ars[min(w.pending)].wait(0.05)
                    self._collect_ready(ars, w.pending, w.outcomes, kind)
                    if streamer is not None:
                        streamer.poll()
                    if on_poll is not None:
                        on_poll(ars)
                    if w.pending and w.time_to_look_for_deaths(time.monotonic()):
                        self._mark_dead(ars, w.pending, w.outcomes)
                    if w.step(time.monotonic()):
                        break
                except KeyboardInterrupt:
                    if w.ctrl_c(time.monotonic()):
                        break  # a further Ctrl-C: stop waiting, ranks stay marked busy
        finally:
            if streamer is not None:
                streamer.close()
        for r in w.pending:  # gave up waiting: the engine is still busy with it
            o = w.outcomes[r]
            if o.status in ("pending", "late"):
                o.status = "timeout"
            self._copy_streams(ars[r], o)
            self.health.busy.add(r)
        return CellResult(ranks=sel, outcomes=w.outcomes, elapsed_s=time.monotonic() - w.t0,
                          streamed=bool(streamer and streamer.started), released=w.released,
                          where=w.where)

    def release(self, ranks: Iterable[int]) -> bool:
        """Release the process groups of ``ranks`` (side doors); True if any answered."""
        alive = [r for r in ranks if r not in self.health.dead]
        answers = knock_all(self.doors, alive, self.token, "release")
        done = [r for r, a in answers.items() if a and "released" in a]
        log.info("released the groups of ranks %s (asked %s)", done, alive)
        if done:
            self.health.group_ok = False
        return bool(done)

    def where(self, ranks: Iterable[int]) -> dict[int, dict | None]:
        """Where each of ``ranks`` is now (works while they are busy)."""
        return knock_all(self.doors, [r for r in ranks if r not in self.health.dead],
                         self.token, "where")

    def _collect_ready(self, ars: dict, pending: set, outcomes: dict, kind: str) -> None:
        for r in list(pending):
            if ars[r].ready():
                self._collect(r, ars[r], outcomes[r], kind)
                pending.discard(r)

    def _mark_dead(self, ars: dict, pending: set, outcomes: dict) -> None:
        for r, how in self.find_dead(pending).items():
            outcomes[r].status, outcomes[r].died = "died", how
            self._copy_streams(ars[r], outcomes[r])
            pending.discard(r)
            self.health.dead[r] = how

    def _collect(self, r: int, ar, o: RankOutcome, kind: str) -> None:
        prior = o.status
        try:
            # results travel on a different socket than printed output; wait
            # for the engine's "idle" so no late stdout is lost
            ar.wait_for_output(5)
        except Exception as e:  # output may be cut short; the result still counts
            log.info("rank %s: late output not awaited: %s: %s", r, type(e).__name__, e)
        self._copy_streams(ar, o)
        try:
            o.value = ar.get(0)
            if kind == "execute":
                o.value = None
            # a rank that finished after its timeout / interrupt still succeeded
            o.status = "ok"
        except Exception as e:  # the rank's own error, carried back by ipyparallel
            o.ename = getattr(e, "ename", type(e).__name__)
            o.evalue = str(getattr(e, "evalue", e))
            tb = getattr(e, "traceback", None)
            o.traceback = tb if isinstance(tb, str) else "\n".join(tb or [])
            o.collective = is_collective_error(o.ename, o.evalue, o.traceback)
            if o.ename == "EngineError":  # ipyparallel noticed the engine vanish
                o.status, o.died = "died", self.death_cause(r) or o.evalue
                self.health.dead[r] = o.died
            elif prior == "late":  # interrupted after a peer's collective failed
                o.status = "timeout" if o.ename == "KeyboardInterrupt" else "error"
            elif (prior in ("timeout", "interrupted") and (o.ename == "KeyboardInterrupt"
                                                          or o.collective)) \
                    or (prior == "stopped" and o.ename == "KeyboardInterrupt"):
                o.status = prior  # stopped by the interrupt, or by the release after it
            else:
                o.status = "error"

    @staticmethod
    def _copy_streams(ar, o: RankOutcome) -> None:
        md = result_metadata(ar)
        o.stdout, o.stderr = md.get("stdout", "") or "", md.get("stderr", "") or ""
        o.outputs = list(md.get("outputs", []) or [])
        o.execute_result = md.get("execute_result")

    # ---------------------------------------------------------------- health
    def death_cause(self, r: int, wait_s: float = 3.0) -> str | None:
        """How rank ``r``'s engine ended, waiting briefly for it to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            how = self.find_dead([r]).get(r)
            if how is not None or time.monotonic() > deadline:
                return how
            time.sleep(0.05)

    def find_dead(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ranks whose engine is gone, with how it ended if known."""
        dead: dict[int, str] = {}
        if self.procs.sees_exits:
            for r in ranks:
                how = self.procs.exit_of(self.ranks[r])
                if how is not None:
                    dead[r] = how
        else:
            alive = set(self.client.ids)
            for r in ranks:
                if self.ranks[r].engine_id not in alive:
                    dead[r] = "its engine unregistered from the controller"
                elif r in self.doors and is_closed(*self.doors[r]):
                    dead[r] = f"its engine on {self.ranks[r].host} is gone (nothing listens " \
                              f"at its side door)"
        return dead

    def refresh_busy(self) -> None:
        """Forget ``busy`` marks of ranks whose engine queue has drained (or that died)."""
        busy = self.health.busy
        if not busy:
            return
        try:
            qs = self.client.queue_status()
        except Exception as e:  # the controller is unreachable: keep the marks
            log.warning("queue_status failed, busy ranks kept: %s: %s", type(e).__name__, e)
            return
        for r in list(busy):
            st = qs.get(self.ranks[r].engine_id, {})
            if isinstance(st, dict) and st.get("queue", 0) == 0 and st.get("tasks", 0) == 0:
                busy.discard(r)
        for r, how in self.find_dead(list(busy)).items():
            busy.discard(r)
            self.health.dead[r] = how

    def interrupt(self, ranks: Iterable[int]) -> None:
        """SIGINT to the engines of ``ranks`` (KeyboardInterrupt there).

        A rank in Python code stops at once; one blocked inside a gloo
        collective only when the collective returns.
        """
        ranks = [r for r in ranks if r not in self.health.dead]
        if not ranks:
            return
        if self.procs.launcher == "local":
            for r in ranks:
                self.procs.interrupt_local(self.ranks[r])
            return
        if self.procs.agents is not None:  # the host agents signal their own engines
            for r in ranks:
                self.procs.signal_remote(self.ranks[r], signal.SIGINT)
            return
        try:
            self.client.send_signal(signal.SIGINT, targets=[self.ranks[r].engine_id for r in ranks],
                                    block=False)
        except Exception as e:  # the controller relays signals; say it did not
            log.warning("interrupting %s through the controller failed: %s", ranks, e)


class _Waiting:
    """The state of one :meth:`Transport.wait`: what is pending, and when to act."""

    def __init__(self, t: Transport, sel: list[int], kind: str, timeout):
        self.t, self.kind, self.timeout = t, kind, timeout
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
        self.deaths_looked_at = 0.0

    def time_to_look_for_deaths(self, now: float) -> bool:
        """Every DEATH_POLL_S: the wait loop wakes at each reply (32 per cell at
        32 ranks), and asking each pending rank's process every time cost
        5 ms per cell there."""
        if now - self.deaths_looked_at < DEATH_POLL_S:
            return False
        self.deaths_looked_at = now
        return True

    def _capture_where(self) -> None:
        """Ask every rank where it is, once, before anything is interrupted."""
        if not self.where:
            answers = self.t.where(range(len(self.t.ranks)))
            self.where = {r: dict(a, running=r in self.pending) for r, a in answers.items() if a}
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
        self.released = self.t.release(range(len(self.t.ranks)))
        self.released_at = now

    def _interrupt(self, now: float, status: str) -> None:
        """SIGINT the pending ranks.  At a cell timeout the culprits are the
        ranks running Python code; those waiting inside a collective for them
        are waiters (unless every pending rank is in a collective)."""
        self._capture_where()
        # a rank already writing its error report finishes by itself: an
        # interrupt would only replace its real error by KeyboardInterrupt
        reporting = self._reporting()
        marked = set(self.pending) - reporting
        if status == "timeout":
            inside = {r for r in self.pending if (self.where.get(r) or {}).get("collective")}
            if inside != marked:
                marked -= inside
        for r in marked:
            self.outcomes[r].status = status
        self.t.interrupt(self.pending - reporting)
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
        if self.kind != "execute" or now - self.failed_at > FINISHING_MAX_S:
            return False
        if self.asked_at is not None and now - self.asked_at < FINISHING_POLL_S:
            return self.finishing
        self.asked_at = now
        answers = self.t.where(sorted(self.pending))
        self.finishing = all(
            a and not a.get("collective") and (a.get("reporting") or not a.get("in_cell"))
            for a in (answers.get(r) for r in self.pending))
        return self.finishing

    def _reporting(self) -> set[int]:
        return {r for r in self.pending if (self.where.get(r) or {}).get("reporting")}

    def step(self, now: float) -> bool:
        """Act on the clock; True to stop waiting."""
        if not self.pending:
            return False
        if self.failed_at is None and any(o.status in ("error", "died")
                                          for o in self.outcomes.values()):
            self.failed_at = now
        if self.failed_at is not None and now - self.failed_at > FAIL_GRACE_S \
                and not self.released and not self._only_finishing(now):
            # the others wait for the failed rank in a collective, or will:
            # free them, and stop the ones still in Python code.  If every
            # failure so far is a collective one, the ranks still running are
            # those that never arrived: they are the culprits, not victims.
            failed = [o for o in self.outcomes.values() if o.status in ("error", "died")]
            waited = all(o.status == "error" and o.collective for o in failed)
            self._release(now)
            # ranks inside a collective now fail by themselves (released): waiters
            inside = {r for r, a in self.where.items() if a.get("collective")} | self._reporting()
            rest = [r for r in self.pending if r not in inside]
            for r in rest:  # "late": a culprit unless it turns out to have been waiting too
                self.outcomes[r].status = "late" if waited else "stopped"
            self.t.interrupt(rest)
        if self.timeout and self.interrupted_at is None and now - self.t0 > self.timeout:
            self._interrupt(now, "timeout")
        if self.interrupted_at is not None and now - self.interrupted_at > RELEASE_AFTER_S[self.kind]:
            self._release(now)
        if self.released_at is not None:
            # ranks still writing their error report will finish: wait longer for them
            grace = RELEASED_GRACE_S + (REPORT_GRACE_S if self.pending <= self._reporting() else 0.0)
            return now - self.released_at > grace
        return (self.interrupted_at is not None
                and now - self.interrupted_at > self.t.timeout_s + 10.0)

    def ctrl_c(self, now: float) -> bool:
        """Ctrl-C: interrupt; a second one releases; a third stops waiting."""
        self.presses += 1
        if self.presses == 1:
            self._interrupt(now, "interrupted")
            return False
        if self.presses == 2 and not self.released:
            self._release(now)
            return False
        return True
