"""Showing what the ranks printed and displayed, grouped by rank.

N ranks running the same cell usually print the same thing; showing it N
times hides the one rank that differs.  So identical output is shown once,
labelled with the ranks that produced it, and only differing output is split
per rank.  Long cells stream: :class:`Streamer` shows output as it arrives.
(Errors are sorted and worded in :mod:`dpnb.cluster.diagnose`.)
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

from ..env import in_kernel, ipython
from ..ranks import rank_label
from ..compat import result_metadata
from . import tabs
from .diagnose import cell_notes, group_identical
from ..engine.collcheck import NOTE_PREFIX
from .types import CellResult

log = logging.getLogger(__name__)

#: a line of glog / c10 logging from torch's or gloo's C++ (``[W1123 21:12:00.96 2835
#: ProcessGroupGloo.cpp:123] ...`` or ``W1123 21:12:00.96 2835 pair.cc:45] ...``)
_NATIVE_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]")


def without_native_logs(text: str, rank: int | None = None) -> str:
    """``text`` without torch's / gloo's C++ log lines; those go to dpnb's log
    (``%dp log``): they describe dpnb's own handling (a released group), not
    the user's code, and made a 0.3 s failure read like a crash."""
    if not text or "]" not in text:
        return text
    kept = []
    for line in text.splitlines(keepends=True):
        if _NATIVE_LOG.match(line):
            log.info("rank %s native log: %s", rank, line.rstrip())
        else:
            kept.append(line)
    return "".join(kept)


def split_notes(text: str) -> tuple[str, list[str]]:
    """A rank's stderr without dpnb's note lines (``NOTE_PREFIX``), and those notes."""
    if not text or NOTE_PREFIX not in text:
        return text, []
    kept, notes = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith(NOTE_PREFIX):
            notes.append(line[len(NOTE_PREFIX):].rstrip("\n"))
        else:
            kept.append(line)
    return "".join(kept), notes


def label(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return f"[all {world} ranks]"
    return f"[{rank_label(ranks)}]"


def render_streams(streams: dict[int, str], world: int) -> str:
    """Text of per-rank streams, identical ones merged."""
    nonempty = {r: t for r, t in streams.items() if t}
    if not nonempty:
        return ""
    parts = []
    for ranks, text in group_identical(nonempty):
        parts.append(f"{label(ranks, len(streams) if len(nonempty) == len(streams) else world)}\n"
                     f"{text if text.endswith(chr(10)) else text + chr(10)}")
    return "".join(parts)


# ------------------------------------------------------------------ display
def show_result(res: CellResult) -> None:
    """Display stdout/stderr, rich outputs and results of a cell, grouped."""
    world = len(res.ranks)
    oc = res.outcomes
    if not res.streamed:
        outs = {r: oc[r].stdout for r in res.ranks}
        text = render_streams(outs, world)
        view = tabs.make() if text and in_kernel() and tabs.wants_tabs(outs) else None
        if view is not None:  # ranks differ, or print a lot: one tab per distinct output
            # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
            from IPython.display import display

            view.update(outs, text)
            display(view.bundle(), raw=True)
        elif text:
            sys.stdout.write(text)
            sys.stdout.flush()
        err = render_streams({r: oc[r].stderr for r in res.ranks}, world)
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()
    _show_rich(res)
    if res.ok:  # a failed cell's report says them
        for n in cell_notes(res):
            sys.stderr.write(f"note: {n}\n")
        sys.stderr.flush()


def _bundle_key(content: dict) -> str:
    try:
        return json.dumps(content.get("data", {}), sort_keys=True, default=str)
    except (TypeError, ValueError) as e:  # json.dumps with default=str rarely fails
        log.debug("display bundle not JSON-comparable (%s); grouping by repr", e)
        return repr(content)


def _show_rich(res: CellResult) -> None:
    world = len(res.ranks)
    oc = res.outcomes
    ip = ipython()
    # display() calls: group identical bundles by position in each rank's list
    n = max((len(oc[r].outputs) for r in res.ranks), default=0)
    for i in range(n):
        items = {r: oc[r].outputs[i] for r in res.ranks if i < len(oc[r].outputs)}
        keys = {r: _bundle_key(c) for r, c in items.items()}
        for ranks, key in group_identical(keys):
            content = items[ranks[0]]
            _publish(ip, content.get("data", {}), content.get("metadata") or {},
                     label(ranks, world))
    results = {r: oc[r].execute_result for r in res.ranks if oc[r].execute_result}
    keys = {r: _bundle_key(c) for r, c in results.items()}
    for ranks, _ in group_identical(keys):
        content = results[ranks[0]]
        _publish(ip, content.get("data", {}), content.get("metadata") or {},
                 f"Out{label(ranks, world)}:", is_result=True)


def _publish(ip, data: dict, metadata: dict, title: str, is_result: bool = False) -> None:
    if ip is not None and in_kernel():
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from IPython.display import publish_display_data

        publish_display_data({"text/plain": title})
        publish_display_data(data, metadata)
    else:
        text = data.get("text/plain")
        if text is None:
            kinds = ", ".join(sorted(data))
            text = f"<{kinds} output: shown in Jupyter>"
        if is_result:
            print(f"{title} {text}")
        else:
            print(f"{title} {text}")


class Streamer:
    """Live output of long cells.

    A cell that finishes within ``delay_s`` is shown only once, grouped.  One
    that runs longer starts streaming: in Jupyter one display area per cell,
    updated in place with each rank's latest output; in a terminal new lines
    are printed with a ``[rank k]`` prefix as they arrive.
    """

    def __init__(self, ars: dict, delay_s: float = 1.0, min_interval_s: float = 0.25):
        self.ars = ars
        self.t0 = time.monotonic()
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.started = False
        self._last = 0.0
        self._printed: dict[int, int] = {r: 0 for r in ars}
        self._handle = None
        self._tabs = None  # a tabs.RankTabs once the ranks' output differs or grows long
        self._handle_is_tabs = False
        self._kernel = in_kernel()

    def _texts(self) -> dict[int, str]:
        out = {}
        for r, ar in self.ars.items():
            md = result_metadata(ar)
            out[r] = (md.get("stdout") or "") + split_notes(
                without_native_logs(md.get("stderr") or ""))[0]
        return out

    def poll(self) -> None:
        now = time.monotonic()
        if now - self.t0 < self.delay_s or now - self._last < self.min_interval_s:
            return
        self._last = now
        texts = self._texts()
        if not self.started and not any(texts.values()):
            return
        self.started = True
        if self._kernel:
            self._show_kernel(texts)
        else:
            self._show_terminal(texts)

    def _show_kernel(self, texts: dict[int, str], final: bool = False) -> None:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from IPython.display import display

        world = len(texts)
        body = render_streams(texts, world) or "(running...)"
        if self._tabs is None and tabs.wants_tabs(texts, running=not final):
            self._tabs = tabs.make() or False
        if self._tabs:
            self._tabs.update(texts, body)  # the widget updates itself in the page
            if self._handle is not None and self._handle_is_tabs and not final:
                return  # (the final update refreshes the saved text form)
            data = self._tabs.bundle()
            self._handle_is_tabs = True
        else:
            # keep the live area short: the tail of each rank's output
            lines = body.splitlines()
            if len(lines) > 60:
                body = "\n".join(["..."] + lines[-60:])
            data = {"text/plain": body}
        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)

    def _show_terminal(self, texts: dict[int, str]) -> None:
        for r, text in texts.items():
            new = text[self._printed[r]:]
            if not new:
                continue
            complete = new.rfind("\n") + 1
            if complete == 0:
                continue
            for line in new[:complete].splitlines():
                sys.stdout.write(f"[rank {r}] {line}\n")
            self._printed[r] += complete
        sys.stdout.flush()

    def close(self) -> None:
        if not self.started:
            return
        texts = self._texts()
        if self._kernel:
            self._show_kernel(texts, final=True)
        else:
            for r, text in texts.items():
                rest = text[self._printed[r]:]
                if rest:
                    for line in rest.splitlines():
                        sys.stdout.write(f"[rank {r}] {line}\n")
                    self._printed[r] = len(text)
            sys.stdout.flush()
