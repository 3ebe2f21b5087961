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
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from dpnb.engine import runner, setup
from ..errors import DpnbError
from ..ippcompat import (output_wait, rank_replies, reply_content, result_metadata,
                         shell_ignores_engine_comms)
from dpnb.engine.cell import outcount
from ..core.cellflags import UNCHECKED_FLAG, with_flags
from .debugging import Desk, ask_user
from .diagnose import is_collective_error
from .launchers import EngineLauncher
from .processes import FROZEN_STATES, frozen_state, oom_counter, oom_kills
from .render import Streamer, split_notes, without_native_logs
from .sidedoor import knock_all
from .worldref import WorldRef
from ..ranks import rank_label
from .types import CellResult, Health, RankOutcome, Status, WaitKind
from .waiting import Waiting

log = logging.getLogger(__name__)

#: how long an engine the controller dropped may take to have its exit reported
#: (an agent's report follows the exit by a moment) before it is dead without a cause
EXIT_REPORT_S = 2.0


def _setup_fn(name: str):
    return getattr(setup, name)


def _runner_fn(name: str):
    return getattr(runner, name)


#: from this many ranks, a value pushed to all of them leaves the notebook once,
#: through ipyparallel's BroadcastView (the controller's tree of schedulers
#: copies it to the engines), not once per engine.  dpnb's engines, alternating
#: (`benchmarks/RESULTS.md`): a 1 MB push at N = 8 16.7 vs 20.4 ms, at N = 32
#: 58.5 vs 75.7 ms; a small push at N = 8 13.8 vs 13.8 ms, at N = 2 4.9 vs 3.9
BROADCAST_MIN_RANKS = 8

#: how often a rank's collected output is compared with its reply's counts
#: while the last of it is still on its way
OUTPUT_POLL_S = 0.002


def has_all_output(md: dict, promised: dict) -> bool:
    """True when ipyparallel has collected (``md``) everything the engine said
    it published for the cell (``promised``, :mod:`dpnb.engine.cell.outcount`)."""
    return (len(md.get("stdout") or "") >= promised.get("stdout", 0)
            and len(md.get("stderr") or "") >= promised.get("stderr", 0)
            and len(md.get("outputs") or ()) >= promised.get("displays", 0)
            and (not promised.get("result") or md.get("execute_result") is not None))


def wait_for_output(ar, timeout: float) -> bool:
    """Wait until a finished rank's output is all here.

    Output travels apart from the reply (IOPub).  When the reply carries the
    engine's counts of what the cell published, this returns once that much
    has arrived (at once for a cell with no output); otherwise, as
    ipyparallel's ``wait_for_output``, when the engine's "idle" status, sent
    after everything else, has arrived.  False if ``timeout`` passed first."""
    promised = reply_content(ar).get(outcount.KEY)
    if not isinstance(promised, dict):
        return ar.wait_for_output(timeout)
    md, idle = result_metadata(ar), output_wait(ar)
    deadline = time.monotonic() + timeout
    while not has_all_output(md, promised):
        if idle(OUTPUT_POLL_S):
            return True
        if time.monotonic() > deadline:
            return False
    return True


def unsendable(name: str, why: str) -> DpnbError:
    """The one-line error for a pulled value that cannot reach the notebook:
    it did not serialize on the engine, or it could not be rebuilt here."""
    return DpnbError(f"{name!r} cannot be sent to the notebook ({why}); pull plain values such "
                     f"as tensors, numbers or a state_dict (for a wrapped model: %dp pull-model)")


def unpack_value(name: str, bufs: list[bytes]):
    """Rebuild a value pulled as ipyparallel buffers (``runner.get_value``)
    here, where a failure can be said in one line."""
    # lazy: `import dpnb.cluster` stays free of ipyparallel
    from ipyparallel.serialize import deserialize_object

    try:
        return deserialize_object(bufs)[0]
    except Exception as e:
        raise unsendable(name, f"rebuilding it here failed: {type(e).__name__}: {e}") from e


class Transport:
    """One cluster's channel to its engines; reads the cluster's current world
    (which engine is which rank, the side doors) and shares ``health`` with it."""

    #: answers a rank's pdb prompt (dpnb.cluster.debugging): input() unless an
    #: instance is given its own (a test's scripted answers)
    ask: Callable[[str], str | None] = staticmethod(ask_user)

    def __init__(self, client, world: WorldRef, health: Health, launcher: EngineLauncher,
                 timeout_s: float):
        self.client = client
        self.worlds = world  # replaced whole when engines are replaced or the group re-forms
        self.health = health
        self.launcher = launcher  # how an engine's death is seen, how it is interrupted
        self.timeout_s = timeout_s
        self._views: dict[int, Any] = {}  # engine id -> its DirectView
        # "direct" / "tree" -> (engine ids, their DirectView / BroadcastView):
        # cells and calls to several ranks / pushes to many; the last of each kept
        self._wide: dict[str, tuple] = {}
        self.token = secrets.token_hex(16)  # opens the engines' side doors
        self.status_seen: tuple | None = None  # the last %dp status answers (cluster/status.py)
        self.oom_base: dict[int, tuple] = {}  # rank -> (its cgroup's OOM counter, the count)
        self.released_again: set[int] = set()  # this break's ranks left behind (leftbehind.py)
        shell_ignores_engine_comms()  # an engine's widget must not break a terminal shell

    def to_record(self) -> dict:
        """The side doors' token, for a kept cluster's record (the doors are the world's)."""
        return {"token": self.token}

    def restore(self, rec: dict) -> None:
        self.token = rec["token"]  # the engines' doors open to the token they were given

    world = property(lambda self: self.worlds.now)  # the current one, read at each use
    ranks = property(lambda self: self.world.ranks)
    doors = property(lambda self: self.world.doors)  # rank -> side door address

    # ---------------------------------------------------------------- views
    def view(self, rank: int):
        """The single-engine view of ``rank``'s engine, made once per engine:
        building a DirectView costs more than sending a short cell."""
        eid = self.ranks[rank].engine_id
        v = self._views.get(eid)
        if v is None:
            v = self._views[eid] = self.client[eid]
        return v

    def _known(self, make: Callable, sel: list[int]) -> Any:
        """``make()``, a send to ``sel``; an engine the controller dropped since the
        last check (a whole host lost: ipyparallel's KeyError, IndexError for one)
        is named dead here, in one line."""
        try:
            return make()
        except (KeyError, IndexError):
            dead = self.find_dead(sel)
            if not dead:
                raise
            for r, how in dead.items():
                self.health.died(r, how)
            raise DpnbError(f"{rank_label(sorted(dead))} died ({dead[min(dead)]}) before the call "
                            f"reached it: run %dp restart to bring back {len(self.ranks)} ranks"
                            ) from None

    # ---------------------------------------------------------------- sending
    def execute(self, code: str, sel: list[int], unchecked: bool = False,
                flags: tuple[str, ...] = ()) -> dict:
        """Send a cell to every rank of ``sel``.  ``unchecked``: each rank counts but
        does not check the cell's collectives; ``flags``: what the layers above ask
        of the cell's run -- both told in the cell's own request
        (:mod:`dpnb.core.cellflags`: no request before it)."""
        code = with_flags(code, (*flags, UNCHECKED_FLAG) if unchecked else flags)
        if len(sel) == 1:
            return self._known(lambda: {sel[0]: self.view(sel[0]).execute(
                code, silent=False, block=False)}, sel)
        # one view for all: its requests leave in one tight loop, and each
        # rank's own reply is read off its message future afterwards (not
        # AsyncResult.split(): see RankReply).  Sent rank by rank, each
        # request woke the client's IO thread while the next one was being
        # built, and the two threads traded the GIL: 10 ms to send a cell to
        # 16 ranks, 1.6 ms this way (cProfile, issue 45); the last rank starts
        # that much sooner (on 2 shared cores the total hardly changed)
        return self._to_many(sel, lambda many: many.execute(code, silent=False, block=False))

    def _to_many(self, sel: list[int], send: Callable, tree: bool = False) -> dict:
        """``send(view)`` to the engines of ``sel`` through one view (``tree``: the
        broadcast one): one AsyncResult; each rank's :class:`RankReply` after."""
        def go() -> dict:
            many = self.many_view(tuple(self.ranks[r].engine_id for r in sel), tree)
            return dict(zip(sel, rank_replies(send(many))))
        return self._known(go, sel)

    def broadcast(self, fn, args: tuple, sel: list[int]) -> dict:
        """``fn(*args)`` on every rank of ``sel``, the arguments sent once through
        the controller's broadcast tree from :data:`BROADCAST_MIN_RANKS` ranks on
        (a push: the value is serialized and sent once, not once per rank);
        each rank still answers on its own, read as a :class:`RankReply`."""
        if len(sel) < BROADCAST_MIN_RANKS:
            return self.apply(fn, args, sel)
        return self._to_many(sel, lambda tree: tree.apply_async(fn, *args), tree=True)

    def many_view(self, eids: tuple, tree: bool = False):
        """The DirectView of these engines (``tree``: their BroadcastView, not
        coalescing, so each engine still replies on its own), made once per
        selection (the last one of each kind kept)."""
        kind = "tree" if tree else "direct"
        got = self._wide.get(kind)
        if got is None or got[0] != eids:
            view = (self.client.broadcast_view(targets=list(eids), is_coalescing=False) if tree
                    else self.client[list(eids)])
            got = self._wide[kind] = (eids, view)
        return got[1]

    def apply(self, fn, args: tuple, sel: list[int], per_rank: dict | None = None) -> dict:
        """``fn(*args)`` on every rank of ``sel`` (``per_rank[r]`` replaces ``args``).
        The same arguments for several ranks leave as a cell does, through one
        view (a pull or a push at N = 64: one AsyncResult, not 64)."""
        if per_rank is None and len(sel) > 1:
            return self._to_many(sel, lambda many: many.apply_async(fn, *args))
        return self._known(lambda: {r: self.view(r).apply_async(
            fn, *(per_rank[r] if per_rank else args)) for r in sel}, sel)

    def call_async(self, dotted: str, args: tuple, kwargs: dict, sel: list[int]) -> dict:
        return self.apply(_runner_fn("call"), (dotted, tuple(args), dict(kwargs)), sel)

    def setup_all(self, name: str, args: tuple = (), *, timeout=None,
                  per_rank: dict | None = None) -> CellResult:
        """:mod:`dpnb.engine.setup` function ``name`` on every rank, all sent before any wait."""
        sel = list(range(len(self.ranks)))
        ars = self.apply(_setup_fn(name), args, sel, per_rank)
        return self.wait(ars, sel, timeout=timeout, stream=False, kind=WaitKind.APPLY)

    def setup_one(self, rank: int, name: str, *args, timeout: float = 60.0):
        return self.view(rank).apply_async(_setup_fn(name), *args).get(timeout=timeout)

    # ---------------------------------------------------------------- waiting
    def wait(self, ars: dict, sel: list[int], *, timeout, stream: bool, kind: WaitKind,
             on_poll: Callable[[dict], None] | None = None,
             ask: Callable[[str], str | None] | None = None) -> CellResult:
        """Wait for every rank, watching for failures, deaths, timeouts and Ctrl-C.

        A rank blocked in a gloo collective ignores SIGINT and waits for its
        peers until the group timeout.  So when a rank fails while others
        still run, or the cell times out, or Ctrl-C comes, and ranks are still
        running a moment later, the notebook *releases* the ranks' process
        groups through their side doors: every blocked collective fails at
        once, and the group is re-formed afterwards (state kept).  Where the
        stopped ranks were is asked first, for the report.  A rank stopped in
        pdb gets its prompt here (``ask``, default :attr:`ask`); the cell's
        timeout does not run while the user answers.
        """
        w = Waiting(self, sel, kind, timeout, say=print if stream else None)
        desk = Desk(self, ask or self.ask)
        streamer = Streamer(ars, delay_s=1.0) if stream else None
        try:
            while w.pending:
                try:
                    ars[min(w.pending)].wait(0.05)
                    self._collect_ready(ars, w.pending, w.outcomes, kind)
                    if streamer is not None:
                        streamer.poll()
                    if w.pending and w.prompted(desk.poll(ars, w.pending)) and streamer:
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
            if o.status in (Status.PENDING, Status.LATE):
                o.status = Status.TIMEOUT
            elif o.status == Status.DEADLOCKED:
                o.status = Status.TIMEOUT  # the release did not free it: report it as stuck
            self._copy_streams(ars[r], o)
            self.health.still_busy(r)
        return CellResult(ranks=sel, outcomes=w.outcomes, elapsed_s=time.monotonic() - w.t0,
                          streamed=bool(streamer and streamer.started), released=w.released,
                          where=w.where, cell_timeout_s=timeout,
                          shown_live=streamer.shown_live if streamer else set())

    def release(self, ranks: Iterable[int]) -> bool:
        """Release the process groups of ``ranks`` (side doors); True if any answered."""
        alive = [r for r in ranks if r not in self.health.dead]
        answers = knock_all(self.doors, alive, self.token, "release")
        done = [r for r, a in answers.items() if a and "released" in a]
        log.info("released the groups of ranks %s (asked %s)", done, alive)
        if done:
            self.health.group_broken(f"the groups of {rank_label(done)} released (side door)")
        return bool(done)

    def where(self, ranks: Iterable[int]) -> dict[int, dict | None]:
        """Where each of ``ranks`` is now (works while they are busy)."""
        return knock_all(self.doors, [r for r in ranks if r not in self.health.dead],
                         self.token, "where")

    def _collect_ready(self, ars: dict, pending: set, outcomes: dict, kind: WaitKind) -> None:
        for r in list(pending):
            if ars[r].ready():
                self._collect(r, ars[r], outcomes[r], kind)
                pending.discard(r)

    def _mark_dead(self, ars: dict, pending: set, outcomes: dict) -> None:
        for r, how in self.find_dead(pending).items():
            outcomes[r].status, outcomes[r].died = Status.DIED, how
            self._copy_streams(ars[r], outcomes[r])
            pending.discard(r)
            self.health.died(r, how)

    def _collect(self, r: int, ar, o: RankOutcome, kind: WaitKind) -> None:
        prior = o.status
        try:
            # results travel on a different socket than printed output; wait
            # until all the cell's output is here, so no late stdout is lost.
            # A value's move prints nothing: its idle status, 4-5 ms behind
            # the reply, is not waited for (a pull at N = 32: 3 ms of 87)
            if kind != WaitKind.VALUE:
                wait_for_output(ar, 5)
        except Exception as e:  # output may be cut short; the result still counts
            log.info("rank %s: late output not awaited: %s: %s", r, type(e).__name__, e)
        self._copy_streams(ar, o)
        carried = reply_content(ar).get(outcount.CARRY_KEY)
        o.carry = carried if isinstance(carried, dict) else {}
        try:
            o.value = ar.get(0)
            if kind == WaitKind.EXECUTE:
                o.value = None
            # a rank that finished after its timeout / interrupt still succeeded
            o.status = Status.OK
        except Exception as e:  # the rank's own error, carried back by ipyparallel
            o.ename = getattr(e, "ename", type(e).__name__)
            o.evalue = str(getattr(e, "evalue", e))
            tb = getattr(e, "traceback", None)
            o.traceback = tb if isinstance(tb, str) else "\n".join(tb or [])
            o.collective = is_collective_error(o.ename, o.evalue, o.traceback)
            if o.ename == "EngineError":  # ipyparallel noticed the engine vanish
                o.status, o.died = Status.DIED, self.death_cause(r) or o.evalue
                self.health.died(r, o.died)
            elif prior == "deadlocked" and o.collective:  # released from a certain deadlock
                o.status = prior
            elif prior == "late":  # interrupted after a peer's collective failed
                o.status = Status.TIMEOUT if o.ename == "KeyboardInterrupt" else Status.ERROR
            elif (prior in ("timeout", "interrupted") and (o.ename == "KeyboardInterrupt"
                                                          or o.collective)) \
                    or (prior == "stopped" and o.ename == "KeyboardInterrupt"):
                o.status = prior  # stopped by the interrupt, or by the release after it
            else:
                o.status = Status.ERROR

    @staticmethod
    def _copy_streams(ar, o: RankOutcome) -> None:
        md = result_metadata(ar)
        o.stdout = md.get("stdout", "") or ""
        o.stderr, o.notes = split_notes(without_native_logs(md.get("stderr", "") or "", o.rank))
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
        """Ranks whose engine is gone, with how it ended if known.

        The launcher says how an engine ended once it has seen it (a host agent
        reports each exit over its connection, a moment later); an engine the
        controller has already dropped is gone too, and sending to it would
        fail deep in ipyparallel ("No such engine"): seen with two ranks
        SIGKILLed one after the other, the second's exit not yet reported when
        ``restart --resume`` asked the survivors."""
        dead: dict[int, str] = {}
        registered: set | None = None
        for r in ranks:
            how = self.launcher.exit_of(self.ranks[r], self.doors.get(r))
            if how is None:
                registered = self._registered() if registered is None else registered
                if registered and self.ranks[r].engine_id not in registered:
                    # the agent's report follows the exit by a moment: its cause, if it comes
                    how = self.launcher.wait_exit(self.ranks[r], self.doors.get(r),
                                                  EXIT_REPORT_S) or (
                        "its engine left the controller (its exit not yet reported)")
            if how is not None:
                dead[r] = self._oom_cause(r, how)
        return dead

    def _registered(self) -> set:
        """The engine ids the controller lists now (empty: it could not say)."""
        try:
            return set(self.client.ids)
        except Exception as e:  # the controller is unreachable: nobody is taken for dead
            log.warning("listing the controller's engines failed: %s: %s", type(e).__name__, e)
            return set()

    def wait_settled(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for live ranks still running an old cell to finish
        it (nothing is interrupted); the ranks still busy then."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh_busy()
            busy = sorted(r for r in self.health.busy if r not in self.health.dead)
            if not busy or time.monotonic() >= deadline:
                return busy
            time.sleep(0.2)

    def refresh_busy(self) -> None:
        """Forget ``busy`` marks of ranks whose engine queue has drained (or that died)."""
        busy = sorted(self.health.busy)
        if not busy:
            return
        try:
            qs = self.client.queue_status()
        except Exception as e:  # the controller is unreachable: keep the marks
            log.warning("queue_status failed, busy ranks kept: %s: %s", type(e).__name__, e)
            return
        for r in busy:
            st = qs.get(self.ranks[r].engine_id, {})
            if isinstance(st, dict) and st.get("queue", 0) == 0 and st.get("tasks", 0) == 0:
                self.health.settled(r)
        for r, how in self.find_dead(sorted(self.health.busy)).items():
            self.health.settled(r)
            self.health.died(r, how)

    def watch_oom(self, ranks: Iterable[int]) -> None:
        """Note, for each of this host's ``ranks``, its memory cgroup's OOM-kill count
        now (a replaced rank anew): a death by SIGKILL later, with that count grown,
        was the kernel's OOM killer (:meth:`find_dead` says so)."""
        here = socket.gethostname()
        for r in ranks:
            ri = self.ranks[r]
            if self.launcher.engines_here or ri.host == here:
                counter = oom_counter(ri.pid)
                self.oom_base[r] = (counter, oom_kills(counter))

    def _oom_cause(self, r: int, how: str) -> str:
        """``how`` rank ``r`` ended, naming the OOM killer when its cgroup counted a kill."""
        counter, before = self.oom_base.get(r, (None, None))
        after = oom_kills(counter)
        if "SIGKILL" in how and before is not None and after is not None and after > before:
            return (f"killed by the kernel's OOM killer: its memory cgroup reached its limit "
                    f"({counter}: oom_kill {before} -> {after}); ask for less memory per rank, "
                    f"or more for the cgroup")
        return how

    def frozen(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ranks of this host whose engine process is frozen (stopped by SIGSTOP or
        held by a tracer), with how: such a rank runs no code, answers no side door,
        and holds every peer in its next collective until the group timeout."""
        here = socket.gethostname()
        out, away = {}, []
        for r in ranks:
            ri = self.ranks[r]
            if self.launcher.engines_here or ri.host == here:
                how = frozen_state(ri.pid)
                if how is not None:
                    out[r] = f"its engine (PID {ri.pid}) is {how}"
            else:  # another host's: its agent reads the state there (if the launcher has one)
                away.append(r)
        if away:
            states = self.launcher.frozen_states([self.ranks[r] for r in away])
            for r in away:
                ri = self.ranks[r]
                how = FROZEN_STATES.get(states.get((ri.location, ri.pid), ""))
                if how is not None:
                    out[r] = f"its engine (PID {ri.pid} on {ri.host}) is {how}"
        return out

    def interrupt(self, ranks: Iterable[int]) -> None:
        """SIGINT to the engines of ``ranks`` (KeyboardInterrupt there).

        A rank in Python code stops at once; one blocked inside a gloo
        collective only when the collective returns.
        """
        ranks = [r for r in ranks if r not in self.health.dead]
        if not ranks:
            return
        # by PID here, through the host agents, or relayed by the controller
        self.launcher.interrupt([self.ranks[r] for r in ranks])
