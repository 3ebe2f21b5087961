"""pdb on the ranks, the notebook's end: show a stopped rank's prompt, send back the line.

A rank that reaches ``breakpoint()`` publishes its debugger's output and
prompt (:mod:`dpnb.engine.debugging.rankpdb`) on the same channel as the cell's output.
While the notebook waits for a cell, :class:`Desk` looks for such prompts;
for the lowest stopped rank it prints the output, asks the user -- Jupyter's
input box, or the terminal -- and sends the line through that rank's side
door.  Other ranks that stop wait their turn, and the first prompt of each
rank says what the rest are doing.  Where nobody can answer (papermill,
nbconvert, a test without stdin) the rank is told to go on without the
debugger, with a one-line note: never a hang.
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..ippcompat import result_metadata
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from ..ranks import rank_label
from . import sidedoor
from .types import Status, WaitKind

if TYPE_CHECKING:
    from . import Engines as Cluster

log = logging.getLogger(__name__)

DATA_KEY = "dpnb_pdb"  # dpnb.engine.debugging.rankpdb.DATA_KEY (not imported: no torch here)


def ask_user(prompt: str) -> str | None:
    """One line from the user, or None where this kernel cannot ask (no stdin)."""
    try:
        return input(prompt)
    except EOFError:  # Ctrl-D, or stdin closed
        return None
    except OSError as e:  # pytest's captured stdin, a detached process
        log.info("no stdin to ask the pdb prompt on: %s", e)
        return None
    except Exception as e:  # ipykernel without allow_stdin (papermill, nbconvert)
        if type(e).__name__ == "StdinNotImplementedError":
            return None
        raise


def scripted(commands: Iterable[str]) -> Callable[[str], str | None]:
    """An ``ask`` that answers with ``commands`` in order, then ``q`` (``%dp debug -c``)."""
    left = collections.deque(commands)

    def ask(prompt: str) -> str:
        line = left.popleft() if left else "q"
        print(f"{prompt}{line}")
        return line

    return ask


def _split_prompt(text: str) -> tuple[str, str]:
    """The debugger's output and its trailing prompt (``(Pdb rank 1) ``)."""
    i = text.rfind("(Pdb rank ")
    if i < 0:
        return text, "(Pdb) "
    return text[:i], text[i:]


class Desk:
    """The prompts of one wait (one cell or call)."""

    def __init__(self, transport, ask: Callable[[str], str | None]):
        self.t = transport
        self.ask = ask
        self.seen: dict[int, int] = {}
        self.greeted: set[int] = set()
        self.cannot = False  # no stdin here: every stopped rank is told to go on

    def pending_prompts(self, ars: dict, pending: Iterable[int]) -> dict[int, dict]:
        out = {}
        for r in pending:
            data = result_metadata(ars[r]).get("data") or {}
            d = data.get(DATA_KEY)
            if d and d.get("n", 0) > self.seen.get(r, 0):
                out[r] = d
        return out

    def poll(self, ars: dict, pending: set[int]) -> float:
        """Serve the lowest rank waiting at a prompt; the seconds spent asking."""
        stopped = self.pending_prompts(ars, pending)
        if not stopped:
            return 0.0
        r = min(stopped)
        d = stopped[r]
        self.seen[r] = d["n"]
        if self.cannot:  # said once already: let it go on
            self._send(r, None)
            return 0.0
        t0 = time.monotonic()
        text, prompt = _split_prompt(d.get("text", ""))
        if r not in self.greeted:
            self.greeted.add(r)
            self._greet(r, sorted(set(stopped) - {r}), pending)
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
        line = self._ask(r, prompt)
        if line is None:
            self.cannot = True
            print(f"dpnb: rank {r} stopped in pdb, but this notebook cannot prompt (no stdin: "
                  f"papermill, nbconvert); the ranks go on without the debugger this cell")
        self._send(r, line)
        return time.monotonic() - t0

    def _ask(self, r: int, prompt: str) -> str | None:
        try:
            return self.ask(prompt)
        except KeyboardInterrupt:
            self._send(r, "q")  # Ctrl-C at the prompt: quit that rank's debugger, then
            raise               # stop the cell as any Ctrl-C does

    def _send(self, r: int, line: str | None) -> None:
        if r not in self.t.doors:
            log.warning("rank %s has no side door: its debugger cannot be answered", r)
            return
        addr, port = self.t.doors[r]
        got = sidedoor.knock(addr, port, self.t.token, "pdb", 5.0, line=line)
        if not got or not got.get("fed"):
            log.warning("rank %s: pdb line %r not delivered (%s)", r, line, got)

    def _greet(self, r: int, others: list[int], pending: set[int]) -> None:
        """Say which rank the prompt belongs to and what the others are doing."""
        rest = sorted(set(pending) - {r} - set(others))
        bits = []
        if others:
            bits.append(f"{rank_label(others)} also stopped, next in turn")
        if rest:
            answers = self.t.where(rest)
            for q in rest:
                a = answers.get(q) or {}
                c = a.get("collective")
                if c:
                    bits.append(f"rank {q} waits in {c['op']} (it gives up after the "
                                f"{self.t.timeout_s:g} s group timeout)")
                elif a.get("debugger"):
                    bits.append(f"rank {q} stopped in pdb, next in turn")
                else:
                    bits.append(f"rank {q} is running")
        others_text = ("; " + "; ".join(bits)) if bits else ""
        print(f"dpnb: rank {r} stopped in pdb; commands go to rank {r} (c continues, q quits "
              f"the cell on it){others_text}")


def post_mortem(c: "Cluster", rank: int | None, commands=None) -> str:
    """``%dp debug [--rank R] [-c CMD ...]``: pdb on the last failed cell's
    traceback on rank R (default: the first that raised), prompt in the
    notebook; ``commands`` answer the prompts instead (then ``q``).  Where
    nobody can be asked, the frames and their locals, as text."""
    c.require_running()
    f = c.last_failure
    if f is None:
        raise DpnbError("no cell has failed yet: %dp debug opens pdb on the last failed cell")
    failed = [r for r in f.ranks if f.outcomes[r].status == Status.ERROR
              and not f.outcomes[r].collective]
    if rank is None:
        if not failed:
            raise DpnbError("the last failed cell raised on no rank (it timed out or a rank "
                            "died): give --rank R")
        rank = failed[0]
    if not isinstance(rank, int) or not 0 <= rank < c.world_size:
        raise DpnbError(f"--rank {rank!r} is not a rank of this cluster (0-{c.world_size - 1})")
    if rank in c.dead:
        raise DpnbError(f"rank {rank} died ({c.dead[rank]}): nothing to debug there")
    sel = c._select([rank])
    ask = scripted(commands) if commands else None
    ars = c.transport.call_async(ep.POST_MORTEM, (), {}, sel)
    res = c.transport.wait(ars, sel, timeout=None, stream=True, kind=WaitKind.APPLY, ask=ask)
    c._finish(res, True)
    return res.outcomes[rank].value or ""
