"""The answers an agent gets, given by the process that holds the cluster.

The holder -- the notebook's kernel, or ``dpnb mcp`` itself for a kept
cluster no kernel holds -- runs one :class:`AgentService` per cluster behind
its door (:mod:`.door`).  Each tool call is answered here, on the door's
thread, beside whatever the notebook is doing, by these rules:

* tools that need no engine (``where`` through the side doors,
  ``last_error`` / ``setup`` / ``profile_summary`` from the notebook's own
  records, ``interrupt`` by signal) answer at once, always;
* tools that ask the ranks (``status``, ``memory``, ``batch_math``,
  ``train_progress``, the ranks' logs) take the cluster's turn
  (:mod:`dpnb.cluster.turn`) as a *brief* read when it is free; while the
  notebook's cell runs they answer from what the notebook knows (each rank's
  PID and memory here, the live progress the training sends) and never queue
  behind the cell;
* actions and ``run_code`` need the notebook's yes (:class:`AgentGrant`)
  and a free turn: while the human's cell runs they are refused, saying
  why (no interleaving on the engines), and while they run the notebook's
  next call is refused, saying what runs.

Every call is noted (:class:`AgentCall`); the notebook prints the actions as
lines (``%dp agent``, and after each cell) and publishes them for the
sidebar.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum

from ..core.errors import UserError
from ..ranks import parse_ranks
from . import tools
from .policy import Need

log = logging.getLogger(__name__)

#: agent calls each cluster remembers (the notebook shows the latest)
CALLS_KEPT = 200
#: seconds between two progress reports of a running run_code
PROGRESS_EVERY_S = 1.0


class Mode(str, Enum):
    """How a tool meets the notebook: ``free`` (no engine), ``read`` (asks idle ranks,
    answers otherwise while they are busy), ``turn`` (drives the ranks: needs the turn)."""

    FREE = "free"
    READ = "read"
    TURN = "turn"


#: tool -> (what it needs beyond attaching, how it meets the notebook)
TOOLS: dict[str, tuple[Need, Mode]] = {
    "status": (Need.READ, Mode.READ), "where": (Need.READ, Mode.FREE),
    "last_error": (Need.READ, Mode.FREE), "log": (Need.READ, Mode.READ),
    "memory": (Need.READ, Mode.READ), "profile_summary": (Need.READ, Mode.FREE),
    "batch_math": (Need.READ, Mode.READ), "train_progress": (Need.READ, Mode.READ),
    "setup": (Need.READ, Mode.FREE), "interrupt": (Need.ACTIONS, Mode.FREE),
    "restart": (Need.ACTIONS, Mode.TURN), "reform": (Need.ACTIONS, Mode.TURN),
    "save": (Need.ACTIONS, Mode.TURN), "run_code": (Need.CODE, Mode.TURN),
}


class AgentRefused(UserError):
    """The holder refused the call (the message says why and what would allow it)."""


@dataclass(frozen=True)
class AgentCall:
    """One call an agent made: when (epoch s), which server process, which tool, in
    short; how it ended."""

    at: float
    agent_pid: int
    tool: str
    detail: str
    outcome: str

    @property
    def is_action(self) -> bool:
        return TOOLS.get(self.tool, (Need.READ,))[0] != Need.READ

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at))
        return (f"dpnb: agent (dpnb mcp, pid {self.agent_pid}) at {when}: {self.tool}"
                f"{' ' + self.detail if self.detail else ''} -> {self.outcome}")


def _detail(tool: str, args: dict) -> str:
    if tool == "run_code":
        first = (str(args.get("code") or "").strip().splitlines() or [""])[0][:60]
        return f"on ranks {args.get('ranks') or 'all'}: {first!r}"
    return ", ".join(f"{k}={v!r}" for k, v in sorted(args.items()) if v not in (None, ""))


class AgentService:
    """Answers tool calls on cluster ``c`` (a :class:`dpnb.Cluster`) from its holder."""

    def __init__(self, c):
        self.c = c
        self.calls: collections.deque[AgentCall] = collections.deque(maxlen=CALLS_KEPT)
        self.noted = 0  # calls noted so far (the deque keeps the latest CALLS_KEPT)
        self.shown = 0  # how many of them the notebook has looked at
        self._lock = threading.Lock()
        self._live: dict[int, dict] = {}  # each rank's latest progress (the feed's thread)
        subscribe = getattr(c, "subscribe", None)
        self._unsubscribe = subscribe(self._on_event) if subscribe else None

    def _on_event(self, ev) -> None:
        self._live[ev.rank] = ev.as_dict()

    # ---------------------------------------------------------------- record
    def note(self, call: AgentCall) -> None:
        with self._lock:
            self.calls.append(call)
            self.noted += 1

    def unshown_lines(self) -> list[str]:
        """The agent's actions the notebook has not printed yet, one line each (at most
        the latest CALLS_KEPT calls' worth)."""
        with self._lock:
            fresh = min(self.noted - self.shown, len(self.calls))
            new = list(self.calls)[len(self.calls) - fresh:] if fresh else []
            self.shown = self.noted
        return [k.line() for k in new if k.is_action]

    def summary(self) -> dict:
        """What the sidebar and ``%dp agent`` show: the grant, the agents seen, the
        latest actions."""
        with self._lock:
            calls = list(self.calls)
        seen: dict[int, float] = {}
        for k in calls:
            seen[k.agent_pid] = k.at
        g = self.c.agent_grant
        return {"allowed": {"actions": g.actions, "code": g.code},
                "agents": [{"pid": p, "last_call": t} for p, t in sorted(seen.items())],
                "actions": [k.line() for k in calls if k.is_action][-10:]}

    # ---------------------------------------------------------------- answer
    def answer(self, tool: str, args: dict, agent_pid: int, *, on_progress=None,
               cancelled=None) -> dict:
        """Answer ``tool(**args)`` for the agent ``agent_pid``; raises :class:`AgentRefused`
        or the tool's own error.  ``on_progress(dict)`` / ``cancelled()``: for run_code."""
        t0, outcome = time.monotonic(), "ok"
        try:
            out = self._answer(tool, args, on_progress, cancelled)
            if isinstance(out, dict) and out.get("ok") is False:
                outcome = "failed"
            return out
        except Exception as e:
            first = (str(e).splitlines() or [""])[0].split(";")[0]
            if not first.startswith("refused"):
                first = f"{'refused' if isinstance(e, AgentRefused) else 'error'}: {first}"
            outcome = first[:120]
            raise
        finally:
            self.note(AgentCall(time.time(), agent_pid, tool, _detail(tool, args),
                                f"{outcome} ({time.monotonic() - t0:.1f} s)"))

    def _answer(self, tool: str, args: dict, on_progress, cancelled) -> dict:
        if tool not in TOOLS:
            raise AgentRefused(f"no tool {tool!r} here: one of {', '.join(sorted(TOOLS))}")
        need, mode = TOOLS[tool]
        if need != Need.READ:
            why = self.c.agent_grant.refusal(tool, need.value)
            if why:
                raise AgentRefused(why)
        c = self.c
        if mode == Mode.FREE:
            return self._free(tool, args)
        if mode == Mode.READ:
            return self._read(tool, args)
        if tool == "run_code":
            return self._run_code(args, on_progress, cancelled)
        with self._turn(tool):
            if tool == "restart":
                return tools.restart(c, bool(args.get("hard")), args.get("resume"))
            if tool == "reform":
                return tools.reform(c)
            return tools.save(c, str(args["path"]))

    def _free(self, tool: str, args: dict) -> dict:
        c = self.c
        if tool == "where":
            return tools.where(c, args.get("ranks"))
        if tool == "last_error":
            return tools.last_error(c)
        if tool == "setup":
            return tools.setup(c)
        if tool == "profile_summary":
            return tools.profile_summary(c)
        if tool == "log" and not args.get("ranks"):
            return tools.log_records(c, int(args.get("last", 20)), False)
        return tools.interrupt(c, args.get("ranks"))

    def _read(self, tool: str, args: dict) -> dict:
        c = self.c
        held = c.turn.try_take(f"an agent's {tool}", brief=True)
        if held is not None:  # the notebook (or an agent's long call) drives the ranks
            return self._while_busy(tool, held)
        try:
            if tool == "log":
                return tools.log_records(c, int(args.get("last", 20)), True)
            return getattr(tools, tool)(c)
        finally:
            c.turn.release()

    def _while_busy(self, tool: str, held) -> dict:
        running = f"{held.who} (for {held.age_s():.0f} s)"
        if tool == "status":
            return tools.status(self.c, running)
        if tool == "train_progress":
            return tools.train_live(self.c, dict(self._live), running)
        return {"available": False,
                "why": f"the ranks are running {running}: {tool} asks them between cells; "
                       f"where and last_error answer now, interrupt stops the cell"}

    def _turn(self, tool: str):
        """The turn for an agent's ``tool`` on this thread, or :class:`AgentRefused`."""
        c = self.c
        held = c.turn.try_take(f"an agent's {tool}")
        if held is not None:
            raise AgentRefused(f"refused: the ranks are running {held.who} (for {held.age_s():.0f} "
                          f"s) and {tool} would interleave with it; nothing was done (where "
                          f"shows what it runs, interrupt stops it; try again when it ends)")
        return _Held(c.turn)

    def _run_code(self, args: dict, on_progress, cancelled) -> dict:
        """run_code on a thread of its own, holding the turn there; meanwhile each rank's
        where-line goes to ``on_progress`` every second, and a cancelled call (the agent
        went away) interrupts the ranks it started."""
        c = self.c
        sel = parse_ranks(args.get("ranks"), c.world_size)
        box: dict = {}
        taken = threading.Event()

        def work():
            try:
                with self._turn("run_code"):
                    taken.set()
                    box["out"] = tools.run_code(c, str(args["code"]), args.get("ranks"),
                                                float(args.get("timeout_s", 30.0)),
                                                bool(args.get("profile")))
            except BaseException as e:  # carried to the door's thread, raised there
                box["error"] = e
            finally:
                taken.set()

        t = threading.Thread(target=work, name="dpnb-agent-run-code", daemon=True)
        t0 = time.monotonic()
        t.start()
        taken.wait()
        stopped = False

        def stop(why: str) -> bool:
            log.info("%s during run_code: interrupting ranks %s", why, sel)
            c.interrupt(sel)
            return True

        while t.is_alive():
            t.join(PROGRESS_EVERY_S)
            if not t.is_alive() or stopped:
                continue
            if cancelled is not None and cancelled():
                stopped = stop("the agent cancelled")
            elif on_progress is not None:
                try:
                    on_progress({"elapsed_s": round(time.monotonic() - t0, 1),
                                 "where": c.where(sel)})
                except OSError as e:  # the agent is gone: as a cancellation
                    stopped = stop(f"the agent went away ({e})")
        if "error" in box:
            raise box["error"]
        out = box["out"]
        if stopped:
            out["cancelled"] = "the agent cancelled the call: its ranks were interrupted"
        return out

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()


class _Held:
    """The turn taken by this thread, released on leaving the ``with``."""

    def __init__(self, turn):
        self.turn = turn

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.turn.release()
        return False
