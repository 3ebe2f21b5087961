"""JupyterLab's debugger across the ranks: the notebook kernel's Debug Adapter Protocol, routed.

JupyterLab sends DAP requests to the notebook's kernel (``debug_request`` on
the control channel); ipykernel hands them to its debugpy, which sees only
the kernel's own process.  :class:`DapRouter` stands in front of it
(``kernel.do_debug_request``, installed by :mod:`dpnb.magics.debugger`):

* what concerns the kernel goes to debugpy as before (``initialize``,
  ``attach``, ``dumpCell``, ``source``, a non-``%%dp`` cell's stops);
* breakpoints are also kept here, by the path JupyterLab gave the cell;
  a ``%%dp`` cell run while the debugger is on carries them to its ranks
  (:func:`dpnb.core.cellflags.dap_flag`), whose hook traces the cell
  (:mod:`dpnb.engine.debugging.rankdap`);
* while such a cell runs, a thread here asks each of its ranks (side door,
  ``dap`` ``state``) every :data:`POLL_S`; a rank's new stop becomes a
  ``stopped`` event for a thread of its own (id :data:`THREAD_BASE` +
  rank, named "rank R · MainThread");
* ``threads`` lists the kernel's threads and the running cell's ranks
  (JupyterLab's Callstack panel shows one thread: a rank's stack is followed
  by the other stopped ranks', and its Continue moves every stopped rank --
  :meth:`DapRouter._continue_all` says why);
  ``stackTrace``, ``scopes``, ``variables``, ``evaluate``, ``continue``,
  ``next``, ``stepIn``, ``stepOut`` on a rank's thread, frame or variable
  go to that rank's side door, with ids translated both ways (ids here start
  at :data:`ID_BASE`, far above debugpy's).

No rank talks to another.  A rank stopped at a breakpoint holds its peers at
their next collective for as long as the group's timeout allows (the
cluster's: torch's 30 minutes unless ``--timeout`` said otherwise).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import contextmanager

from dpnb.cluster import sidedoor
from dpnb.core.cellflags import DapCell
from dpnb.engine import entrypoints as ep

from . import hooks

log = logging.getLogger(__name__)

THREAD_BASE = 1_000_000_000  # rank r's main thread; debugpy numbers its threads from 1
ID_BASE = 1 << 40  # frames and variables; debugpy's count up from 1
POLL_S = 0.1  # a stop is shown this long after it happens, at most
KNOCK_S = 12.0  # a stopped rank answers within rankdap.ANSWER_S
RANK_STEPS = ("continue", "next", "stepIn", "stepOut")


class DapRouter:
    """The kernel's debugger, spanning the ranks (see the module's docstring)."""

    def __init__(self, kernel_request: Callable[[dict], Awaitable[dict]],
                 publish: Callable[[dict], None], cluster: Callable[[], object]):
        self.kernel_request = kernel_request
        self.publish = publish
        self.cluster = cluster
        self.breaks: dict[str, tuple[int, ...]] = {}
        self.on = False  # JupyterLab's debugger attached
        self.lab = False  # the client is JupyterLab's debugger: Continue moves every rank
        self.armed: set[int] = set()  # engine PIDs whose hook is registered
        self.cell_ranks: tuple[int, ...] = ()  # the debugged cell's ranks while it runs
        self.seen: dict[int, int] = {}  # rank -> the stop serial last announced
        self.stopped: set[int] = set()
        self.ids: dict[int, tuple[int, str, int]] = {}  # our id -> (rank, "frame"|"var", theirs)
        self._next = itertools.count(ID_BASE)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the cell
    def cell(self, path: str, shift: int) -> DapCell | None:
        """What a ``%%dp`` cell tells its ranks, or None while the debugger is off."""
        if not self.on:
            return None
        return DapCell(path, shift, tuple(sorted(self.breaks.items())))

    def arm(self, c, ranks) -> None:
        """Register the ranks' hook on engines not armed yet (an engine's first debugged cell)."""
        hooks.arm(c, ep.DAP_ARM, ranks, self.armed, "debugger", "it runs the cell without stopping")

    @contextmanager
    def running(self, c, ranks):
        """While a debugged cell runs on ``ranks``: their stops become ``stopped`` events."""
        self.cell_ranks = tuple(ranks)
        # stops are told apart by each engine's count; a rank's engine may have been
        # replaced since the last cell (its count starts again)
        self.seen = {}
        done = threading.Event()
        t = threading.Thread(target=self._watch, args=(c, done), name="dpnb-dap-watch",
                             daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(2.0)
            with self._lock:
                self.cell_ranks, self.stopped = (), set()
                self.ids.clear()

    def _watch(self, c, done: threading.Event) -> None:
        while not done.wait(POLL_S):
            answers = sidedoor.knock_all(c.transport.doors, self.cell_ranks, c.transport.token,
                                         "dap", 1.0, req={"op": "state"})
            for r, a in sorted(answers.items()):
                if not a or "serial" not in a:
                    continue
                if a["stopped"] and a["serial"] != self.seen.get(r):
                    self.seen[r] = a["serial"]
                    with self._lock:
                        self.stopped.add(r)
                    self._event("stopped", {"reason": a.get("reason") or "breakpoint",
                                            "threadId": THREAD_BASE + r,
                                            "allThreadsStopped": False,
                                            "description": f"rank {r} stopped"})

    def _event(self, name: str, body: dict) -> None:
        try:
            self.publish({"seq": next(self._seq), "type": "event", "event": name, "body": body})
        except Exception as e:  # JupyterLab misses one event; the cell goes on
            log.warning("debug event %s not published: %s: %s", name, type(e).__name__, e)

    # ------------------------------------------------------------ requests
    async def handle(self, msg: dict) -> dict:
        """One DAP request from JupyterLab: answered here for ranks, by debugpy otherwise."""
        cmd, args = msg.get("command"), msg.get("arguments") or {}
        try:
            mine = self._mine(cmd, args)
            if mine is not None:
                return self._reply(msg, mine)
        except RankDebugError as e:
            return self._reply(msg, None, str(e))
        reply = await self.kernel_request(msg)
        return self._after_kernel(cmd, args, reply)

    def _mine(self, cmd, args: dict):
        """The body of a request about a rank, or None when it is the kernel's."""
        rank = self._thread_rank(args.get("threadId"))
        if cmd == "stackTrace" and rank is not None:
            return self._stack(rank)
        if cmd == "continue" and self.lab and (rank is not None or self.stopped):
            return self._continue_all()
        if cmd in RANK_STEPS and rank is not None:
            if cmd == "continue" and rank not in self.stopped:
                return {"allThreadsContinued": False}  # already running: nothing to move
            self._ask(rank, {"op": cmd})
            with self._lock:
                self.stopped.discard(rank)
                rest = sorted(self.stopped)
            if rest:  # JupyterLab cleared its panel: show the next stopped rank there
                self._event("stopped", {"reason": "breakpoint", "threadId": THREAD_BASE + rest[0],
                                        "allThreadsStopped": False,
                                        "description": f"rank {rest[0]} stopped"})
            return {"allThreadsContinued": False}
        if cmd == "pause" and rank is not None:
            raise RankDebugError(f"rank {rank} cannot be paused while it runs: set a breakpoint")
        if cmd == "scopes" and args.get("frameId") in self.ids:
            r, _, i = self.ids[args["frameId"]]
            got = self._ask(r, {"op": "scopes", "frame": i})
            return {"scopes": [{"name": s["name"], "variablesReference": self._id(r, "var", s["ref"]),
                                "expensive": False, "presentationHint": s["name"].lower()}
                               for s in got["scopes"]]}
        if cmd == "variables" and args.get("variablesReference") in self.ids:
            r, _, ref = self.ids[args["variablesReference"]]
            got = self._ask(r, {"op": "variables", "ref": ref})
            return {"variables": [{"name": v["name"], "value": v["value"], "type": v["type"],
                                   "evaluateName": v["name"],
                                   "variablesReference": self._id(r, "var", v["ref"]) if v["ref"] else 0}
                                  for v in got["variables"]]}
        if cmd in ("evaluate", "richInspectVariables") and args.get("frameId") in self.ids:
            r, _, i = self.ids[args["frameId"]]
            expr = args.get("expression") or args.get("variableName") or ""
            got = self._ask(r, {"op": "evaluate", "frame": i, "expression": expr})
            if cmd == "richInspectVariables":
                return {"data": {"text/plain": got["result"]}, "metadata": {}}
            return {"result": got["result"], "type": got["type"],
                    "variablesReference": self._id(r, "var", got["ref"]) if got["ref"] else 0}
        return None

    def _continue_all(self) -> dict:
        """JupyterLab's Continue: every stopped rank goes on.

        Its Callstack panel shows one thread, and its Continue names another:
        it drops the shown thread from its stopped set *before* naming the
        request's thread (the next stopped one, or thread 1 when none is
        left -- the kernel's, with a lone rank stopped).  One rank per
        Continue would move a rank the user is not looking at, or none."""
        with self._lock:
            todo, self.stopped = sorted(self.stopped), set()
        for r in todo:
            self._ask(r, {"op": "continue"})
        return {"allThreadsContinued": True}

    def _after_kernel(self, cmd, args: dict, reply: dict) -> dict:
        """debugpy's answer, with what the ranks add to it."""
        if not isinstance(reply, dict):
            return reply
        body = reply.setdefault("body", {}) if reply.get("success", True) else None
        if cmd in ("initialize", "attach") and reply.get("success"):
            self.on = True
            if cmd == "initialize":
                self.lab = args.get("clientID") == "jupyterlab"
        elif cmd == "disconnect":
            self._off()
        elif cmd == "setBreakpoints":
            self._set_breaks(args)
        elif cmd == "threads" and body is not None:
            body["threads"] = list(body.get("threads") or []) + [
                {"id": THREAD_BASE + r, "name": f"rank {r} · MainThread"} for r in self.cell_ranks]
        elif cmd == "debugInfo" and body is not None:
            body["stoppedThreads"] = list(body.get("stoppedThreads") or []) + [
                THREAD_BASE + r for r in sorted(self.stopped)]
        elif cmd == "continue" and self._thread_rank(args.get("threadId")) is None \
                and "threadId" not in args:
            for r in sorted(self.stopped):
                self._ask(r, {"op": "continue"})
            self.stopped.clear()
        return reply

    def _set_breaks(self, args: dict) -> None:
        path = (args.get("source") or {}).get("path")
        if not path:
            return
        lines = tuple(sorted({int(b["line"]) for b in args.get("breakpoints") or [] if "line" in b}))
        if lines:
            self.breaks[path] = lines
        else:
            self.breaks.pop(path, None)
        c = self.cluster()
        if self.cell_ranks and c is not None:  # ranks running a cell take the change now
            for r in self.cell_ranks:
                self._knock(c, r, {"op": "breaks", "breaks": {p: list(ls) for p, ls in self.breaks.items()}})

    def _off(self) -> None:
        """The debugger detached: no rank stays stopped, no cell is traced."""
        self.on = False
        self.breaks.clear()
        for r in sorted(self.stopped):
            try:
                self._ask(r, {"op": "continue"})
            except RankDebugError as e:
                log.warning("rank %s not resumed at disconnect: %s", r, e)
        self.stopped.clear()

    # ------------------------------------------------------------ helpers
    def _thread_rank(self, tid) -> int | None:
        if isinstance(tid, int) and tid >= THREAD_BASE and tid - THREAD_BASE in self.cell_ranks:
            return tid - THREAD_BASE
        return None

    def _stack(self, rank: int) -> dict:
        """The rank's frames, then every other stopped rank's, each named with its rank.

        JupyterLab's Callstack panel shows one thread's frames (the first
        stopped one's) and has no thread list: the other stopped ranks follow
        there, so every stopped rank is in view, and a click on a frame shows
        that rank's variables (the frame's id is that rank's)."""
        frames = []
        for r in [rank] + sorted(self.stopped - {rank}):
            try:
                got = self._ask(r, {"op": "stack"})
            except RankDebugError as e:
                if r == rank:
                    raise
                log.info("rank %s's frames left out of rank %s's stack: %s", r, rank, e)
                continue
            frames += [{"id": self._id(r, "frame", f["frame"]), "name": f"rank {r} · {f['name']}",
                        "line": f["line"], "column": 1,
                        "source": {"name": os.path.basename(f["path"]), "path": f["path"]}}
                       for f in got["frames"]]
        return {"stackFrames": frames, "totalFrames": len(frames)}

    def _id(self, rank: int, kind: str, theirs: int) -> int:
        with self._lock:
            mine = next(self._next)
            self.ids[mine] = (rank, kind, int(theirs))
        return mine

    def _ask(self, rank: int, req: dict) -> dict:
        c = self.cluster()
        if c is None:
            raise RankDebugError("no dpnb cluster is running")
        got = self._knock(c, rank, req)
        if got is None:
            raise RankDebugError(f"rank {rank}'s side door did not answer")
        if "error" in got:
            raise RankDebugError(str(got["error"]))
        return got

    @staticmethod
    def _knock(c, rank: int, req: dict) -> dict | None:
        door = c.transport.doors.get(rank)
        if door is None:
            return None
        return sidedoor.knock(door[0], door[1], c.transport.token, "dap", KNOCK_S, req=req)

    def _reply(self, msg: dict, body, error: str | None = None) -> dict:
        out = {"seq": next(self._seq), "type": "response", "request_seq": msg.get("seq"),
               "command": msg.get("command"), "success": error is None, "body": body or {}}
        if error is not None:
            out["message"] = error
        return out


class RankDebugError(Exception):
    """A debugger request a rank could not answer (said to JupyterLab, not raised in a cell)."""
