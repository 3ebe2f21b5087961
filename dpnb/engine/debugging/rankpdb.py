"""pdb on a rank, with its prompt in the notebook.

An engine has no terminal: ``breakpoint()`` used to read an empty stdin and
carry on as if nothing happened.  Here ``breakpoint()``, ``pdb.set_trace()``
and ``torch.distributed.breakpoint()`` open a :class:`RankPdb` whose
input and output go through the notebook instead:

* output -- the listing, ``p`` results, the prompt -- is buffered, and when
  pdb asks for a line the buffer goes to the notebook as an IPython
  ``data_message`` (``ipyparallel.datapub.publish_data``: the same channel as
  the cell's output, so it arrives in order with it);
* the notebook shows it, asks the user (Jupyter's input box, a terminal
  prompt), and sends the line back through the rank's side door, whose
  thread puts it on this rank's queue; pdb runs it and asks again, or
  continues.

The notebook handles one stopped rank at a time (:mod:`dpnb.cluster.debugging`).
Where nobody can answer (papermill, nbconvert: no stdin), it sends
*detach*: the rank continues, and further breakpoints in the same cell are
skipped -- never a hang.  ``%dp debug`` opens the same debugger post mortem
on the last failed cell's traceback.  No communication between ranks.
"""

from __future__ import annotations

import io
import logging
import os
import pdb
import queue
import sys
import threading
import traceback

from dpnb import compat
from dpnb.engine.debugging import postmortem as debug, frames
from dpnb.engine.group.lifecycle import hold_timeout
from dpnb.engine.state import get_state

log = logging.getLogger(__name__)

#: the key of the data_message that carries a prompt to the notebook
DATA_KEY = "dpnb_pdb"
#: how often a rank waiting for its next pdb line wakes (so Ctrl-C reaches it)
WAKE_S = 0.2
#: modules whose frames ``next`` and ``step`` pass over (dpnb.engine.debugging.frames)
SKIP = list(frames.STEP_SKIP)


class Channel(io.TextIOBase):
    """pdb's stdin and stdout on a rank: a buffer out, a queue in."""

    def __init__(self, rank: int):
        self.rank = rank
        self.out = io.StringIO()
        self.lines: queue.Queue = queue.Queue()
        self.n = 0  # prompts published so far
        self.prompting = False
        self.detached = False

    def write(self, s: str) -> int:
        return self.out.write(s)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text

    def readline(self, *_size) -> str:
        if self.detached:
            return "continue\n"
        # lazy: publishing needs an engine's kernel (the prompt only runs inside one)
        from ipyparallel.datapub import publish_data

        self.n += 1
        publish_data({DATA_KEY: {"n": self.n, "rank": self.rank, "text": self.take()}})
        self.prompting = True
        try:
            while True:
                try:
                    line = self.lines.get(timeout=WAKE_S)
                    break
                except queue.Empty:
                    continue
        finally:
            self.prompting = False
        if line is None:  # the notebook cannot prompt: go on, and stop no more this cell
            self.detached = True
            return "continue\n"
        return line.rstrip("\n") + "\n"

    def feed(self, line: str | None) -> None:
        """A line from the notebook (side-door thread); None detaches."""
        self.lines.put(line)


class RankPdb(pdb.Pdb):
    """pdb with its prompt in the notebook (see the module's docstring)."""

    def __init__(self, state):
        self.state = state
        self.chan = Channel(state.rank)
        super().__init__(stdin=self.chan, stdout=self.chan, nosigint=True, readrc=False,
                         skip=SKIP)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {state.rank}) "

    def interaction(self, frame, tb_or_exc):
        st = self.state
        st.debugger = self
        try:
            return super().interaction(frame, tb_or_exc)
        finally:
            st.debugger = None
            rest = self.chan.take()
            if rest:
                sys.stdout.write(rest)
            if self.chan.detached:
                st.debug_detached = True

    # IPython runs each top-level statement of a cell as its own code object:
    # the start or end of one is not a place to stop, its first line is
    _cell_statement = staticmethod(frames.is_cell_statement)

    def user_call(self, frame, argument_list):
        if self._cell_statement(frame):
            return
        super().user_call(frame, argument_list)

    def user_return(self, frame, return_value):
        if self._cell_statement(frame):
            self.set_step()
            return
        super().user_return(frame, return_value)

    def get_stack(self, f, t):
        """pdb's frame list from the outermost frame of the user's code on:
        below it are the engine's own (ipyparallel, ipykernel, tornado,
        IPython, dpnb's cell runner), about 40 frames that ``where`` printed
        before the cell's and ``up`` climbed into.  A stack with no user code
        (a stop inside a library called by dpnb) is left whole."""
        stack, i = super().get_stack(f, t)
        first = next((k for k, (fr, _) in enumerate(stack)
                      if not frames.is_library(fr.f_code.co_filename)), None)
        if first is None or first > i:
            return stack, i
        return stack[first:], i - first

    def format_stack_entry(self, frame_lineno, lprefix=": "):
        """A cell's entry named as dpnb names it elsewhere (``cell line 6``,
        :func:`dpnb.engine.debugging.frames.label`), not by the temporary file ipykernel
        compiled it from (``/tmp/ipykernel_123/3744619388.py(6)``)."""
        text = super().format_stack_entry(frame_lineno, lprefix)
        frame, lineno = frame_lineno
        name = frame.f_code.co_filename
        head = f"{self.canonic(name)}({lineno!r})"
        if frames.is_cell(name) and text.startswith(head):
            text = f"{frames.label(frame, lineno)}, in " + text[len(head):]
        return text

    def do_interact(self, arg):
        self.message("interact is not available on a rank: use p, pp or !statement")

    def where(self) -> dict:
        """Where this rank is stopped (for the side door's ``where``)."""
        f = self.curframe
        return {"at": frames.label(f) if f is not None else "", "prompting": self.chan.prompting}


def _stop_here(state, frame) -> None:
    if getattr(state, "debug_detached", False) or os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("breakpoint() in a thread other than the main one is skipped on rank %s",
                    state.rank)
        return
    state.debug_used = True
    RankPdb(state).set_trace(frame)


def settle(state) -> None:
    """At the end of a cell that used the debugger: no tracing is left behind
    (``next`` on a cell's last line would otherwise stop in the next cell)."""
    if getattr(state, "debug_used", False):
        state.debug_used = False
        sys.settrace(None)


class _Hooks:
    """The replacements of ``breakpoint()``, ``pdb.set_trace`` and
    ``torch.distributed.breakpoint``; ``state`` follows re-initialisation."""

    def __init__(self, state):
        self.state = state
        self.skips: dict[int, int] = {}  # dist.breakpoint(skip=): calls seen per place

    def breakpointhook(self, *args, **kwargs):
        _stop_here(self.state, sys._getframe(1))

    def set_trace(self, *, header=None):
        if header is not None:
            print(header)
        _stop_here(self.state, sys._getframe(1))

    def dist_breakpoint(self, rank: int = 0, skip: int = 0, timeout_s=3600):
        """torch's ``dist.breakpoint``: ``skip`` first calls from the same
        place pass (torch's count), then ``timeout_s`` becomes every group's
        timeout (as torch sets it: the ranks waiting in the barrier below must
        not give up while ``rank`` is being debugged) -- the default group's,
        and the collective check's wait, until the cell ends (then the
        cluster's again, :func:`dpnb.engine.group.lifecycle.hold_timeout`); the
        other groups' stay, as under torch."""
        # lazy: torch-free at import (boot loads torch in a background thread)
        import torch.distributed as dist

        if skip > 0:
            key = hash(str(traceback.format_exc()))  # torch's key for "this breakpoint"
            self.skips[key] = self.skips.get(key, 0) + 1
            if self.skips[key] <= skip:
                return
        if timeout_s is not None:
            compat.set_other_groups_timeout(float(timeout_s))
            hold_timeout(self.state, float(timeout_s))
        if self.state.rank == rank:
            _stop_here(self.state, sys._getframe(1))
        dist.barrier()  # as torch's own: the other ranks wait for the debugged one


def install(state) -> None:
    """Route every way into pdb on this engine to :class:`RankPdb` (once; re-pointed later)."""
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch.distributed as dist

    hooks = getattr(state, "pdb_hooks", None)
    if hooks is None:
        hooks = _Hooks(state)
        sys.breakpointhook = hooks.breakpointhook
        pdb.set_trace = hooks.set_trace
        dist.breakpoint = hooks.dist_breakpoint
        state.pdb_hooks = hooks
    hooks.state = state


def feed(state, line: str | None) -> bool:
    """Give the rank's waiting debugger a line (side door); False if none waits."""
    dbg = getattr(state, "debugger", None)
    if dbg is None:
        return False
    dbg.chan.feed(line)
    return True


def post_mortem(ns: dict) -> str:
    """``%dp debug``: pdb on the last failed cell's traceback, prompt in the
    notebook.  Where the notebook cannot prompt: the frames and their locals
    as text (:func:`dpnb.engine.debugging.postmortem.post_mortem`)."""

    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return "no failed cell on this rank"
    st = get_state(ns)
    st.debug_detached = False
    p = RankPdb(st)
    p.reset()
    p.interaction(None, tb)
    st.debug_detached = False
    return debug.post_mortem(ns) if p.chan.detached else ""
