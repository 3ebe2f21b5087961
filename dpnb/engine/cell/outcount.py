"""A cell's reply says what output the cell published, so the notebook stops
waiting as soon as it has all of it.

A cell's reply and its output take two roads from an engine to the notebook:
the reply goes through the controller's queue, the output (stdout, stderr,
displays, the cell's value) through the IOPub relay, sent by the kernel's
publishing thread.  The reply can arrive first, so the notebook used to wait
for each engine's "idle" status, which the kernel publishes after the reply
(on this 2-core machine 4-5 ms after it, per engine, measured at N = 8).
For a cell that printed nothing that wait was all there was to wait for.

Here each engine counts, per cell, what it handed to IOPub for that cell
(characters of stdout and of stderr, display messages, the value) and puts
the counts into the cell's ``execute_reply`` (``reply[KEY]``), whose content
ipyparallel keeps.  The kernel flushes stdout and stderr before it sends the
reply (``ipykernel.kernelbase.Kernel.execute_request``), so the counts are
final when they are written.  The notebook (``dpnb.cluster.outputs``)
returns a rank's result once its collected output reaches the counts -- at
once for a cell with no output -- and waits for "idle" as before whenever the
counts are missing: an error, an ``apply`` call, a message it cannot count
(a ``\\r`` in a stream, which ipyparallel's client rewrites; widgets' comm
messages; anything else but status).

A successful cell's reply also carries what this rank's hooks left for the
notebook while the cell ran (``reply[CARRY_KEY]``, the engine state's ``carry``): a
profiled cell's record (:mod:`dpnb.engine.metrics.profilemark`), so the
profile comes home with the cell instead of in a call after it.

The kernel's echo of each cell's source (``execute_input``), which dpnb's
notebook never shows, is not published at all: at N ranks it was N copies
of the cell through the controller per cell (dropping it took 7 % off a
``pass`` cell at N = 8, measured alternating on one cluster).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from dpnb.engine.state import STATE_NAME
from dpnb.ippcompat import drop_input_echo

log = logging.getLogger(__name__)

#: the reply content's key the notebook reads (dpnb.cluster.outputs)
KEY = "dpnb_outputs"
#: the reply's field for what the rank's hooks carry home with the cell
CARRY_KEY = "dpnb_carry"
MARK = "__dpnb_outcount__"
#: published for every cell and never shown: not counted, never a reason to wait
IGNORED = frozenset({"status", "execute_input"})


def zero() -> dict:
    return {"stdout": 0, "stderr": 0, "displays": 0, "result": False}


class Counts:
    """What each cell still running published so far, by its request's msg_id.
    Written from the kernel's main thread (displays, the value) and its
    publishing thread (streams), hence the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cells: dict[str, dict | None] = {}  # None: something not countable was sent

    def begin(self, msg_id: str) -> None:
        with self.lock:
            self.cells[msg_id] = zero()

    def note(self, msg: dict | None) -> None:
        if not msg:
            return
        msg_id = (msg.get("parent_header") or {}).get("msg_id")
        kind = (msg.get("header") or {}).get("msg_type")
        with self.lock:
            c = self.cells.get(msg_id)
            if c is None or kind in IGNORED:
                return
            content = msg.get("content") or {}
            if kind == "stream" and content.get("name") in ("stdout", "stderr") \
                    and "\r" not in content.get("text", ""):
                c[content["name"]] += len(content.get("text", ""))
            elif kind == "display_data":
                c["displays"] += 1
            elif kind == "execute_result":
                c["result"] = True
            else:  # the notebook cannot tell when this arrived: wait for idle
                self.cells[msg_id] = None

    def end(self, msg_id: str) -> dict | None:
        with self.lock:
            return self.cells.pop(msg_id, None)


def install(kernel: Any) -> bool:
    """Count this kernel's output per cell and put the counts in each
    successful ``execute_reply`` (once per process)."""
    session = getattr(kernel, "session", None)
    if session is None or getattr(kernel.finish_metadata, MARK, False):
        return False
    shell = getattr(kernel, "shell", None)
    publishers = [sys.stdout, sys.stderr, getattr(shell, "display_pub", None),
                  getattr(shell, "displayhook", None)]
    if any(getattr(p, "session", session) is not session for p in publishers):
        # output this wrapper would not see: the notebook keeps waiting for idle
        log.warning("output not counted: a publisher has its own session")
        return False
    counts = Counts()
    send, init_md, finish_md = session.send, kernel.init_metadata, kernel.finish_metadata

    def counting_send(*args, **kwargs):
        msg = send(*args, **kwargs)
        counts.note(msg if isinstance(msg, dict) else None)
        return msg

    def init_metadata(parent, *args, **kwargs):
        if parent.get("header", {}).get("msg_type") == "execute_request":
            counts.begin(parent["header"]["msg_id"])
        return init_md(parent, *args, **kwargs)

    def finish_metadata(parent, metadata, reply_content, *args, **kwargs):
        md = finish_md(parent, metadata, reply_content, *args, **kwargs)
        got = counts.end(parent.get("header", {}).get("msg_id"))
        if got is not None and reply_content.get("status") == "ok":
            reply_content[KEY] = got
        st = getattr(shell, "user_ns", {}).get(STATE_NAME)
        # only a successful reply: ipyparallel's client keeps an error reply's
        # content only as the exception it raises, so a failed cell's carry
        # stays here for the notebook's call (profile.end finds it)
        if st is not None and st.carry and reply_content.get("status") == "ok":
            reply_content[CARRY_KEY], st.carry = st.carry, {}
        return md

    drop_input_echo(kernel)  # never shown: not published, nothing to count or carry
    setattr(finish_metadata, MARK, True)
    session.send = counting_send
    kernel.init_metadata, kernel.finish_metadata = init_metadata, finish_metadata
    return True
