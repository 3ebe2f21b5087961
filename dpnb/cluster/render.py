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
from ..ippcompat import result_metadata
from dpnb.engine.proc.process import DISPLAY_UPDATE
from . import tabs
from .diagnose import cell_notes, group_identical
from dpnb.engine.cell.collcheck import NOTE_PREFIX
from .types import CellResult

log = logging.getLogger(__name__)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
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


def live_key(content: dict) -> tuple | None:
    """The key of a display meant to change while the cell runs, else None:
    one with a ``display_id`` (updated through its handle) or a widget (its
    model updates itself over the proxied comm).  These are shown as they
    come, per rank; other displays are shown once the cell ends, grouped."""
    did = (content.get("transient") or {}).get("display_id")
    if did is not None:
        return ("display", did)
    view = (content.get("data") or {}).get(WIDGET_VIEW)
    if isinstance(view, dict) and view.get("model_id"):
        return ("widget", view["model_id"])
    return None


def fold_updates(outputs: list) -> list:
    """A rank's displays with each update applied where its display is: an
    update (:data:`DISPLAY_UPDATE`, sent by ``handle.update``) replaces the
    data of the display with its ``display_id`` and is dropped; one whose
    display is not in the list (made in an earlier cell) is shown as new."""
    out: list = []
    at: dict = {}
    for c in outputs:
        t = c.get("transient") or {}
        did = t.get("display_id")
        if did is not None and t.get(DISPLAY_UPDATE) and did in at:
            out[at[did]] = {**out[at[did]], "data": c.get("data", {}),
                            "metadata": c.get("metadata") or {}}
            continue
        if did is not None:
            at[did] = len(out)
        out.append(c)
    return out


def _show_rich(res: CellResult) -> None:
    world = len(res.ranks)
    oc = res.outcomes
    ip = ipython()
    # each rank's displays as they last looked, without those shown live
    outs = {r: [c for c in fold_updates(oc[r].outputs) if (r, live_key(c)) not in res.shown_live]
            for r in res.ranks}
    # display() calls: group identical bundles by position in each rank's list
    n = max((len(outs[r]) for r in res.ranks), default=0)
    for i in range(n):
        items = {r: outs[r][i] for r in res.ranks if i < len(outs[r])}
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
    are printed with a ``[rank k]`` prefix as they arrive.  In Jupyter the
    displays meant to change (:func:`live_key`: a progress table redrawn
    through its display handle, a widget bar) are shown as they come too,
    each rank's under its label, and updated in place; ``shown_live`` names
    them, so the grouped display at the end leaves them out.
    """

    def __init__(self, ars: dict, delay_s: float = 1.0, min_interval_s: float = 0.25):
        self.ars = ars
        self.t0 = time.monotonic()
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.started = False
        self._last = 0.0
        self._printed: dict[tuple, int] = {}  # (rank, stream) -> characters printed
        self._handle = None
        self._tabs = None  # a tabs.RankTabs once the ranks' output differs or grows long
        self._handle_is_tabs = False
        self._kernel = in_kernel()
        self._seen_outputs: dict[int, int] = {r: 0 for r in ars}
        self._live: dict[tuple, object] = {}  # (rank, live_key) -> its display handle

    @property
    def shown_live(self) -> set:
        """``{(rank, live_key), ...}`` of the displays this streamer showed."""
        return set(self._live)

    def _streams(self, whole_lines: bool = False) -> dict[int, tuple[str, str]]:
        """Each rank's ``(stdout, stderr)`` so far; with ``whole_lines``, each
        up to its last newline (``print`` writes its text and its newline
        separately, and the engine may send the text alone)."""
        out = {}
        for r, ar in self.ars.items():
            md = result_metadata(ar)
            parts = (md.get("stdout") or "",
                     split_notes(without_native_logs(md.get("stderr") or "", r))[0])
            out[r] = tuple(p[:p.rfind("\n") + 1] for p in parts) if whole_lines else parts
        return out

    def _texts(self) -> dict[int, str]:
        """Each rank's stdout, then its stderr, as one text: a line still being
        printed ends where it is, not in the stderr's first line (the live
        area is redrawn whole, so its end shows once it comes)."""
        return {r: "".join(p if not p or p.endswith("\n") else p + "\n" for p in parts)
                for r, parts in self._streams().items()}

    def poll(self) -> None:
        now = time.monotonic()
        if now - self.t0 < self.delay_s or now - self._last < self.min_interval_s:
            return
        self._last = now
        if self._kernel:
            self._show_live_displays()
        texts = self._texts()
        if not self.started and not any(texts.values()):
            return
        self.started = True
        if self._kernel:
            self._show_kernel(texts)
        else:
            self._show_terminal()

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

    def _show_live_displays(self) -> None:
        """Show the new displays meant to change (:func:`live_key`), and
        apply the updates that arrived since the last poll (the latest
        only: a table redrawn 20 times in 0.25 s is drawn once)."""
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from IPython.display import display, publish_display_data

        for r, ar in self.ars.items():
            outs = result_metadata(ar).get("outputs") or []
            latest: dict = {}
            for c in outs[self._seen_outputs[r]:]:
                key = live_key(c)
                if key is not None:
                    latest[key] = c
            self._seen_outputs[r] = len(outs)
            for key, c in latest.items():
                data, md = c.get("data", {}), c.get("metadata") or {}
                handle = self._live.get((r, key))
                if handle is None:
                    publish_display_data({"text/plain": f"[rank {r}]"})
                    self._live[(r, key)] = display(data, metadata=md, raw=True, display_id=True)
                elif key[0] == "display":  # (a widget redraws itself)
                    handle.update(data, metadata=md, raw=True)

    def _show_terminal(self, final: bool = False) -> None:
        """The lines new since the last poll, each with its rank: printed
        lines stay printed, so only whole ones (all at the end); stdout and
        stderr counted apart (each grows on its own)."""
        for r, parts in self._streams(whole_lines=not final).items():
            for name, text in zip(("stdout", "stderr"), parts):
                done = self._printed.get((r, name), 0)
                for line in text[done:].splitlines():
                    sys.stdout.write(f"[rank {r}] {line}\n")
                self._printed[(r, name)] = len(text)
        sys.stdout.flush()

    def close(self) -> None:
        if self._live:  # the last updates of what is shown live
            self._show_live_displays()
        if not self.started:
            return
        if self._kernel:
            self._show_kernel(self._texts(), final=True)
        else:
            self._show_terminal(final=True)
