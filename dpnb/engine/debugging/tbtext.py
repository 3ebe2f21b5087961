"""A failed cell's traceback, written cheaply on each rank.

When a cell raises on N ranks, every rank's IPython formats its traceback
(``ultratb``) and sends the text back; the notebook groups the N texts and
shows each distinct one once (``dpnb.cluster.diagnose``).  IPython's
formatter costs ~5 ms per traceback on a rank that imported torch: it asks
``inspect.getmodule`` for every frame, which scans all of ``sys.modules``
(tens of thousands of torch modules) for a cell's file that is in none, and
sets up a pygments formatter for colours the notebook strips anyway.  With
N engines sharing a machine's cores those milliseconds add up to most of the
time an error report takes.

This module writes the same text -- IPython's default ("Context") layout,
without colours: the header, each frame as ``Cell In[3], line 4`` or
``File path:line, in fn(args)`` with two lines either side and the ``---->``
arrow, chained exceptions, the ``ExcName: message`` line -- from the frames
alone (file, line, function, ``linecache``), with no module scan.  The
notebook reads it as before (``diagnose.user_line`` parses the same marks), so
the report the user sees is unchanged.  Other ``%xmode`` settings, and
anything this formatter cannot handle, go to IPython's own.
"""

from __future__ import annotations

import inspect
import linecache
import logging
import os
import sys
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

WIDTH = 75  # IPython's: min(75, terminal width); an engine has no terminal
NUMBERS = 7  # IPython's INDENT_SIZE - 1: the line-number column
#: lines shown before and after a frame's current line (IPython: context 5 for
#: the raised exception, 3 for the ones chained to it)
AROUND, AROUND_CHAINED = 2, 1
REPEATS = 3  # consecutive identical frames shown before they are folded (recursion)
MARK = "__dpnb_cheap_tb__"


def _compress_user(path: str) -> str:
    home = os.path.join(os.path.expanduser("~"), "")
    return "~" + os.sep + path[len(home):] if path.startswith(home) else path


def _hidden(frame: FrameType) -> bool:
    """IPython's own frames (``run_code``) and frames that ask to be hidden."""
    name = frame.f_globals.get("__name__") or ""
    return name.split(".", 1)[0] == "IPython" or bool(frame.f_locals.get("__tracebackhide__"))


def _call(frame: FrameType) -> str:
    """``in fn(a, b)`` (argument names, as IPython's Context mode), '' at module level."""
    code = frame.f_code
    func = getattr(code, "co_qualname", code.co_name)
    if code.co_name == "<module>":
        return ""
    try:
        args = inspect.formatargvalues(*inspect.getargvalues(frame), formatvalue=lambda v: "")
    except Exception as e:  # IPython writes the same when a frame's arguments cannot be read
        log.info("arguments of %s not read: %s: %s", func, type(e).__name__, e)
        args = "(***failed resolving arguments***)"
    return f"in {func}{args}"


def _label(filename: str, lineno: int, shell) -> str:
    names = getattr(shell, "compile", None)  # the shell's compiler knows its cells' file names
    named = names.format_code_name(filename) if names is not None else None
    if named is not None:
        return f"{named[0]} {named[1]}, line {lineno}"
    return f"File {_compress_user(filename)}:{lineno}"


def _last_line(code) -> int:
    lines = [ln for _, _, ln in code.co_lines() if ln]
    return max(lines) if lines else code.co_firstlineno


def _source(frame: FrameType, lineno: int, around: int) -> str:
    """The frame's current line with ``around`` lines either side, inside its
    own code (blank lines left out, as IPython does)."""
    code = frame.f_code
    lines = linecache.getlines(code.co_filename, frame.f_globals)
    if not lines:
        return ""
    first = max(code.co_firstlineno, lineno - around, 1)
    last = min(_last_line(code), lineno + around, len(lines))
    shown = [(n, lines[n - 1].rstrip("\n") if n <= len(lines) else "")
             for n in range(first, max(last, lineno) + 1)]
    shown = [(n, t) for n, t in shown if n == lineno or t.strip()]
    cut = min((len(t) - len(t.lstrip()) for _, t in shown if t.strip()), default=0)
    out = []
    for n, text in shown:
        text = text[cut:]  # dedented to the lines shown, as IPython does
        if n == lineno:
            pad = NUMBERS - len(str(n))
            arrow = "-" * (pad - 2) + "> " if pad >= 2 else ">" * pad
            out.append(f"{arrow}{n} {text}")
        else:
            out.append(f"{n:>{NUMBERS}} {text}")
    return "\n".join(out) + "\n"


def _ours(frame: FrameType) -> bool:
    """A frame of dpnb's own code (a wrapper that refuses for torch, a cell's check)."""
    return (frame.f_globals.get("__name__") or "").split(".", 1)[0] == "dpnb"


def _frames(tb: TracebackType | None) -> list[tuple[FrameType, int]]:
    """The frames shown: hidden ones left out, except the one that raised (as
    IPython does) -- unless it is dpnb's own: a refusal that dpnb raises for
    torch (``init_process_group``'s checks) ends at the user's call, as
    torch's own raise would under torchrun, whenever a frame is left."""
    out = []
    while tb is not None:
        last = tb.tb_next is None
        if not _hidden(tb.tb_frame) or (last and not (_ours(tb.tb_frame) and out)):
            out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _one(etype: type, evalue: BaseException | None, tb: TracebackType | None,
         around: int, shell) -> list[str]:
    """IPython's parts for one exception: header, frames, message, notes."""
    name = getattr(etype, "__name__", str(etype))
    parts = [name + "Traceback (most recent call last)".rjust(WIDTH - len(name))]
    frames = _frames(tb)
    i = 0
    while i < len(frames):
        frame, lineno = frames[i]
        key = (frame.f_code, lineno)
        j = i
        while j + 1 < len(frames) and (frames[j + 1][0].f_code, frames[j + 1][1]) == key:
            j += 1
        if j - i >= REPEATS:  # recursion: fold the run, as IPython's stack_data does
            parts.append(f"    [... skipping similar frames: {frame.f_code.co_name} at line "
                         f"{lineno} ({j - i} times)]\n")
            i = j
            continue
        call = _call(frame)
        parts.append(_label(frame.f_code.co_filename, lineno, shell)
                     + (", " + call if call else "") + "\n" + _source(frame, lineno, around))
        i += 1
    try:
        message = str(evalue)
    except Exception as e:  # a user's exception whose __str__ fails
        log.info("str() of a %s failed: %s: %s", name, type(e).__name__, e)
        message = f"<unprintable {name} object>"
    parts.append(f"{name}: {message}")
    notes = getattr(evalue, "__notes__", None)
    if isinstance(notes, (list, tuple)):
        parts += [str(n) for n in notes]
    return parts


def _chain(evalue: BaseException | None) -> BaseException | None:
    if evalue is None:
        return None
    if evalue.__cause__ is not None:
        return evalue.__cause__
    return None if evalue.__suppress_context__ else evalue.__context__


def structured(etype: type, evalue: BaseException | None, tb: TracebackType | None,
               shell=None) -> list[str]:
    """IPython's structured traceback (a list of strings) for this exception
    and the ones chained to it, earliest first, without colours."""
    blocks = [_one(etype, evalue, tb, AROUND, shell)]
    seen = {id(evalue)}
    cur = evalue
    while (nxt := _chain(cur)) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        blocks.append(["\nThe above exception was the direct cause of the following exception:\n"
                       if cur.__cause__ is not None else
                       "\nDuring handling of the above exception, another exception occurred:\n"])
        blocks.append(_one(type(nxt), nxt, nxt.__traceback__, AROUND_CHAINED, shell))
        cur = nxt
    out = ["-" * WIDTH]
    for b in reversed(blocks):
        out += b
    return out


def install(shell) -> bool:
    """Make ``shell``'s tracebacks cheap (once per process); IPython's own
    formatter stays for other ``%xmode`` settings and as the fallback."""
    itb = getattr(shell, "InteractiveTB", None)
    if itb is None or getattr(itb.structured_traceback, MARK, False):
        return False
    original = itb.structured_traceback

    def structured_traceback(etype=None, evalue=None, etb=None, tb_offset=None,
                             context: int = 5) -> list[str]:
        if etype is None:
            etype, evalue, etb = sys.exc_info()
        if getattr(itb, "mode", "Context") != "Context" or isinstance(etb, tuple) \
                or not isinstance(etype, type):
            return original(etype, evalue, etb, tb_offset, context)
        itb.tb = etb  # what IPython's own formatter keeps for its debugger
        try:
            return structured(etype, evalue, etb, shell)
        except Exception as e:  # never lose the user's error to the formatter's
            log.warning("cheap traceback failed, IPython's used: %s: %s", type(e).__name__, e)
            return original(etype, evalue, etb, tb_offset, context)

    setattr(structured_traceback, MARK, True)
    itb.structured_traceback = structured_traceback
    return True


def uninstall(shell) -> Any:
    """Back to IPython's formatter (tests, comparisons)."""
    itb = getattr(shell, "InteractiveTB", None)
    if itb is not None and "structured_traceback" in vars(itb):
        del itb.structured_traceback
