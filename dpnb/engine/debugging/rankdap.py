"""JupyterLab's debugger on a rank: a breakpoint set in a ``%%dp`` cell's gutter stops it here.

Who talks to whom.  JupyterLab speaks the Debug Adapter Protocol to the
notebook's kernel; dpnb's router there (:mod:`dpnb.cluster.dap`) answers what
concerns the ranks and leaves the rest to the kernel's own debugpy.  A
``%%dp`` cell run while that debugger is on carries one flag line
(``# dpnb: --dap {...}``, :mod:`dpnb.core.cellflags`): the path the
notebook's debugger knows the cell by, how many lines the engine's copy is
shifted (the ``%%dp`` line), and every breakpoint by path.  This rank's
``pre_run_cell`` hook maps the engine's own file for the cell to that path,
and when a breakpoint lies in a file it knows, traces the cell
(:class:`RankDap`, a :mod:`bdb` debugger -- no debugpy, no listener).

A rank that reaches a breakpoint stops in its main thread and serves the
side door's ``dap`` requests (:func:`request`, from the door's thread: the
stack, scopes, variables, evaluate, continue / next / stepIn / stepOut) one
at a time, run by the stopped thread itself.  The router polls ``state``
to learn of a stop.  No communication between ranks: a stopped rank's peers
wait in their next collective, as long as the group's timeout (the
cluster's; torch's 30 minutes by default).  Ctrl-C (interrupt) ends the stop
like any cell.  Torch-free.
"""

from __future__ import annotations

import bdb
import logging
import queue
import reprlib
import sys
import threading
import types
from dataclasses import dataclass

from dpnb.core.cellflags import DapCell, dap_cell
from dpnb.engine.debugging import frames
from dpnb.engine.proc.shell import user_ns
from dpnb.engine.state import get_state

log = logging.getLogger(__name__)

#: how often a stopped rank wakes to let Ctrl-C in
WAKE_S = 0.2
#: the longest the door's thread waits for the stopped thread's answer
ANSWER_S = 10.0
#: children listed per variable (a dict of a million entries is not a panel)
MAX_CHILDREN = 300
RESUME = ("continue", "next", "stepIn", "stepOut")

_NEVER = object()  # a stop frame no frame is: trace, stop at breakpoints only
_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 200, 200, 20, 20


@dataclass(frozen=True)
class Known:
    """A cell file of this engine, as the notebook's debugger knows it."""

    path: str
    shift: int  # notebook line = engine line + shift


def safe_repr(obj) -> str:
    try:
        return _repr.repr(obj)
    except Exception as e:  # a broken __repr__ is the user's; the panel says so
        return f"<repr failed: {type(e).__name__}: {e}>"


def _expandable(obj) -> bool:
    if isinstance(obj, (dict, list, tuple, set, frozenset)):
        return len(obj) > 0
    if isinstance(obj, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
                        types.MethodType, str, bytes, int, float, complex, bool)) or obj is None:
        return False
    return bool(getattr(obj, "__dict__", None))


class RankDap(bdb.Bdb):
    """This rank's debugger for the notebook's DAP session (see the module's docstring)."""

    def __init__(self, rank: int):
        super().__init__(skip=frames.STEP_SKIP)
        self.rank = rank
        self.files: dict[str, Known] = {}  # engine file -> notebook path
        self.points: dict[str, set[int]] = {}  # notebook path -> lines (notebook numbering)
        self.cmds: queue.Queue = queue.Queue()
        self.serial = 0  # stops so far (the router tells a new stop by it)
        self.reason = ""
        self.stack: list = []  # the stopped stack, innermost first
        self.refs: list = []  # variablesReference - 1 -> what it expands
        self.tracing = False

    # ------------------------------------------------------------ the cell
    def begin(self, engine_file: str, cell: DapCell) -> None:
        """A flagged cell is about to run (main thread): learn its path, trace if it may stop."""
        self.files[engine_file] = Known(cell.path, cell.shift)
        self.points = cell.points()
        known = {k.path for k in self.files.values()}
        if not any(self.points.get(p) for p in known):
            return
        self.reset()
        self.stopframe, self.returnframe, self.stoplineno = _NEVER, None, -1
        self.tracing = True
        sys.settrace(self.trace_dispatch)

    def end(self) -> None:
        """The cell ended (main thread): nothing traced into the next one."""
        if self.tracing:
            sys.settrace(None)
            self.tracing = False

    # ------------------------------------------------------------ where to stop
    def _known(self, frame) -> Known | None:
        return self.files.get(frame.f_code.co_filename)

    def break_anywhere(self, frame) -> bool:
        k = self._known(frame)
        return k is not None and bool(self.points.get(k.path))

    def break_here(self, frame) -> bool:
        k = self._known(frame)
        return k is not None and frame.f_lineno + k.shift in self.points.get(k.path, ())

    def set_continue(self) -> None:
        # bdb's drops tracing when its own table is empty; ours is elsewhere
        self.stopframe, self.returnframe, self.stoplineno = self.botframe, None, -1

    # bdb's user_call / user_return / user_exception do nothing: a stop is at a line;
    # `next` past a cell statement's end steps into the next one (bdb's dispatch_return)
    def user_line(self, frame) -> None:
        self._stopped(frame, "breakpoint" if self.break_here(frame) else "step")

    # ------------------------------------------------------------ stopped
    def _stopped(self, frame, reason: str) -> None:
        stack = []
        f = frame
        while f is not None:
            stack.append(f)
            f = f.f_back
        # from the outermost frame of the user's code in: the engine's ~40 below it are noise
        user = [i for i, f in enumerate(stack) if not frames.is_library(f.f_code.co_filename)]
        self.stack = stack[:user[-1] + 1] if user else stack[:1]
        self.refs, self.reason = [], reason
        self.serial += 1
        try:
            while True:
                try:
                    req, box = self.cmds.get(timeout=WAKE_S)
                except queue.Empty:
                    continue
                try:
                    out = self._answer(req)
                except Exception as e:  # the request's error, not the stop's
                    out = {"error": f"{type(e).__name__}: {e}"}
                box.put(out)
                if req.get("op") in RESUME and "error" not in out:
                    return
        finally:
            self.stack, self.refs, self.reason = [], [], ""

    def _answer(self, req: dict) -> dict:
        op = req.get("op")
        if op == "stack":
            return {"frames": [self._frame(i, f) for i, f in enumerate(self.stack)]}
        if op == "scopes":
            return {"scopes": self._scopes(self._at(req))}
        if op == "variables":
            return {"variables": self._children(int(req["ref"]))}
        if op == "evaluate":
            return self._evaluate(self._at(req), str(req["expression"]))
        if op in RESUME:
            top = self.stack[0]
            if op == "continue" or (op == "stepOut" and frames.is_cell_statement(top)):
                self.set_continue()
            elif op == "next":
                self.set_next(top)
            elif op == "stepIn":
                self.set_step()
            else:
                self.set_return(top)
            return {"resumed": op}
        raise ValueError(f"unknown dap op {op!r}")

    def _at(self, req: dict):
        i = int(req.get("frame", 0))
        if not 0 <= i < len(self.stack):
            raise ValueError(f"no frame {i} on rank {self.rank}'s stack ({len(self.stack)} frames)")
        return self.stack[i]

    def _frame(self, i: int, f) -> dict:
        k = self._known(f)
        path = k.path if k else f.f_code.co_filename
        return {"frame": i, "name": f.f_code.co_name, "line": f.f_lineno + (k.shift if k else 0),
                "path": path, "cell": k is not None}

    def _ref(self, obj) -> int:
        self.refs.append(obj)
        return len(self.refs)

    def _scopes(self, f) -> list[dict]:
        out = []
        if f.f_code.co_name != "<module>":
            out.append({"name": "Locals", "ref": self._ref(("mapping", dict(f.f_locals)))})
        out.append({"name": "Globals", "ref": self._ref(("mapping", _user_globals(f.f_globals)))})
        return out

    def _children(self, ref: int) -> list[dict]:
        if not 1 <= ref <= len(self.refs):
            raise ValueError(f"no variable {ref} on rank {self.rank} (it has {len(self.refs)})")
        what = self.refs[ref - 1]
        if isinstance(what, tuple) and len(what) == 2 and what[0] == "mapping":
            items = list(what[1].items())
        elif isinstance(what, dict):
            items = [(safe_repr(k), v) for k, v in what.items()]
        elif isinstance(what, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(what)]
        elif isinstance(what, (set, frozenset)):
            items = [(str(i), v) for i, v in enumerate(sorted(what, key=safe_repr))]
        else:
            items = sorted(vars(what).items())
        return [self._variable(str(n), v) for n, v in items[:MAX_CHILDREN]]

    def _variable(self, name: str, v) -> dict:
        return {"name": name, "value": safe_repr(v), "type": type(v).__name__,
                "ref": self._ref(v) if _expandable(v) else 0}

    def _evaluate(self, f, expression: str) -> dict:
        try:
            v = eval(expression, f.f_globals, f.f_locals)
        except SyntaxError:  # a statement, typed in the debug console
            exec(expression, f.f_globals, f.f_locals)
            return {"result": "", "type": "", "ref": 0}
        var = self._variable(expression, v)
        return {"result": var["value"], "type": var["type"], "ref": var["ref"]}

    # ------------------------------------------------------------ the door's side
    def state(self) -> dict:
        return {"serial": self.serial, "stopped": bool(self.stack), "reason": self.reason,
                "tracing": self.tracing}

    def ask(self, req: dict) -> dict:
        """A request for the stopped main thread, from the side door's thread."""
        if not self.stack:
            return {"error": f"rank {self.rank} is running, not stopped"}
        box: queue.Queue = queue.Queue(maxsize=1)
        self.cmds.put((req, box))
        try:
            return box.get(timeout=ANSWER_S)
        except queue.Empty:
            return {"error": f"rank {self.rank} did not answer within {ANSWER_S:.0f} s"}

    def update(self, breaks: dict) -> None:
        """Breakpoints changed in the notebook while this rank runs a cell (door's thread)."""
        self.points = {str(p): {int(n) for n in lines} for p, lines in breaks.items()}


def _user_globals(g: dict) -> dict:
    """The namespace as the user sees it: no IPython or dpnb internals, no modules."""
    from IPython import get_ipython  # lazy: only an engine's shell has hidden names

    ip = get_ipython()
    hidden = getattr(ip, "user_ns_hidden", {}) if ip is not None else {}
    return {k: v for k, v in sorted(g.items())
            if not k.startswith("_") and k not in hidden and not isinstance(v, types.ModuleType)}


class _Hook:
    """The engine's ``pre_run_cell`` / ``post_run_cell`` pair (registered once by :func:`arm`)."""

    def __init__(self, rank: int):
        self.dap = RankDap(rank)

    def pre_run_cell(self, info=None, *_rest) -> None:
        cell = dap_cell(getattr(info, "raw_cell", None))
        if cell is None:
            return
        from IPython import get_ipython  # lazy: the engine's shell names the cell's file

        raw = info.raw_cell
        get_state(user_ns()).dap = self.dap  # the side door finds it there
        if threading.current_thread() is not threading.main_thread():
            log.warning("a debugged cell ran outside the main thread on rank %s", self.dap.rank)
            return
        self.dap.begin(get_ipython().compile.get_code_name(raw, raw, None), cell)

    def post_run_cell(self, *_result) -> None:
        self.dap.end()


def arm(ns: dict) -> bool:
    """Register this engine's hooks (once); True when they are there."""
    from IPython import get_ipython  # lazy: an engine's shell, asked when armed

    shell = get_ipython()
    if shell is None:
        return False
    st = get_state(ns)
    hook = next((cb.__self__ for cb in shell.events.callbacks.get("pre_run_cell", [])
                 if isinstance(getattr(cb, "__self__", None), _Hook)), None)
    if hook is None:  # once per engine process, whatever re-forms came between
        hook = _Hook(st.rank)
        shell.events.register("pre_run_cell", hook.pre_run_cell)
        shell.events.register("post_run_cell", hook.post_run_cell)
    hook.dap.rank = st.rank
    st.dap = hook.dap
    return True


def request(state, req: dict) -> dict:
    """The side door's ``dap`` command: ``state`` (is this rank stopped, which stop),
    ``breaks`` (new breakpoints), or a request for the stopped thread."""
    dap = getattr(state, "dap", None)
    if dap is None:
        return {"error": "the debugger is not armed on this rank"}
    op = req.get("op")
    if op == "state":
        return dap.state()
    if op == "breaks":
        dap.update(req.get("breaks") or {})
        return {"ok": True}
    return dap.ask(req)
