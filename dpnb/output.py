"""Showing what the ranks printed, displayed and raised, grouped by rank.

N ranks running the same cell usually print the same thing; showing it N
times hides the one rank that differs.  So identical output is shown once,
labelled with the ranks that produced it, and only differing output is
split per rank.  Errors get the same treatment: one traceback per distinct
failure, the failing ranks named, and the ranks that merely waited for them
(in a collective, until the group timeout) named as such.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import TYPE_CHECKING

from .ranks import rank_label

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import CellResult

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_NO = re.compile(r"Cell In\[\d+\]")

# Errors that mean "a collective or the group failed", not "the user's code
# raised": gloo/NCCL timeouts, a peer closing its connection, store errors.
_COLLECTIVE_ENAMES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}
_COLLECTIVE_PATTERNS = re.compile(
    r"gloo|nccl|Timed out|timed out|Connection closed by peer|Connection reset by peer|"
    r"ProcessGroup|process group|collective operation timeout|Socket Timeout|"
    r"Broken pipe|TCPStore|store_based_barrier|Watchdog", re.I)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text or "")


def is_collective_error(ename: str, evalue: str, traceback: str = "") -> bool:
    """Whether an error came from torch.distributed rather than the user's code."""
    if ename in _COLLECTIVE_ENAMES:
        return True
    if ename == "RuntimeError" and _COLLECTIVE_PATTERNS.search(evalue or ""):
        return True
    return False


def group_identical(items: dict[int, str]) -> list[tuple[list[int], str]]:
    """``{rank: text}`` -> ``[(ranks, text), ...]`` in order of first rank."""
    groups: dict[str, list[int]] = {}
    for r in sorted(items):
        groups.setdefault(items[r], []).append(r)
    return sorted(((rs, t) for t, rs in groups.items()), key=lambda g: g[0][0])


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


def user_line(traceback: str) -> str:
    """The user's failing line from an IPython traceback: ``cell line 3: x = f()``."""
    tb = strip_ansi(traceback)
    lines = tb.splitlines()
    where = None
    for i, line in enumerate(lines):
        m = re.match(r"\s*Cell In\[\d+\], line (\d+)", line)
        if m:
            where = m.group(1)
            for nxt in lines[i + 1:]:
                if nxt.lstrip().startswith("Cell In[") or nxt.startswith("File "):
                    break
                a = re.match(r"\s*-+>\s*(\d+)\s?(.*)", nxt)
                if a:
                    return f"cell line {a.group(1)}: {a.group(2).strip()}"
            return f"cell line {where}"
    return ""


def _short_tb(traceback: str, limit: int = 40) -> str:
    lines = strip_ansi(traceback).rstrip().splitlines()
    if len(lines) > limit:
        lines = lines[:8] + [f"    ... ({len(lines) - limit + 8} lines) ..."] + lines[-(limit - 9):]
    return "\n".join(lines)


def error_report(res: "CellResult", *, culprits: list[int], waiting: list[int],
                 timeout_s: float, reform_msg: str = "") -> tuple[str, str]:
    """``(summary, report)`` for a cell that failed on some ranks."""
    oc = res.outcomes
    lines: list[str] = []
    summary_bits: list[str] = []

    died = [r for r in res.ranks if oc[r].status == "died"]
    for r in died:
        lines.append(f"rank {r} died: {oc[r].died}")
        summary_bits.append(f"rank {r} died")

    # Execution counts differ between ranks (``Cell In[7]`` vs ``In[9]``);
    # they must not split an otherwise identical failure.
    errs = {r: _CELL_NO.sub("Cell In[_]", f"{oc[r].ename}: {oc[r].evalue}\n"
                                          f"{strip_ansi(oc[r].traceback)}")
            for r in res.ranks if oc[r].status == "error" and r not in waiting}
    for ranks, _ in group_identical(errs):
        o = oc[ranks[0]]
        where = user_line(o.traceback)
        head = f"{rank_label(ranks)} raised {o.ename}: {o.evalue}".rstrip(": ")
        lines.append(head + (f"\n    at {where}" if where else ""))
        tb = _short_tb(o.traceback)
        if tb:
            lines.append(_indent(tb))
        summary_bits.append(f"{rank_label(ranks)} raised {o.ename}")

    timed = [r for r in res.ranks if oc[r].status == "timeout"]
    if timed:
        lines.append(f"{rank_label(timed)} did not finish within the cell timeout "
                     f"({res.elapsed_s:.1f} s elapsed) and {'was' if len(timed) == 1 else 'were'} "
                     f"interrupted")
        summary_bits.append(f"{rank_label(timed)} timed out")
    intr = [r for r in res.ranks if oc[r].status == "interrupted"]
    if intr:
        lines.append(f"{rank_label(intr)} interrupted (Ctrl-C)")
        summary_bits.append(f"{rank_label(intr)} interrupted")

    if waiting:
        on = rank_label(culprits) if culprits else "a peer"
        o = oc[waiting[0]]
        lines.append(
            f"{rank_label(waiting)} {'was' if len(waiting) == 1 else 'were'} waiting on {on} in a "
            f"collective until the peer went away or the {timeout_s:g} s group timeout "
            f"released {'it' if len(waiting) == 1 else 'them'} "
            f"({o.ename}: {_first_line(o.evalue)})")
        summary_bits.append(f"{rank_label(waiting)} waiting on {on}")

    if reform_msg:
        lines.append(reform_msg)
    summary = "; ".join(summary_bits) or "the cell failed"
    if reform_msg and "re-formed" in reform_msg:
        summary += " (process group re-formed, state kept)"
    report = "\n".join(lines)
    return summary, report


def _first_line(s: str) -> str:
    s = strip_ansi(s or "").strip().splitlines()
    return (s[0][:200] if s else "")


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


# ------------------------------------------------------------------ display
def _ipython():
    try:
        from IPython import get_ipython

        return get_ipython()
    except Exception:  # pragma: no cover
        return None


def in_kernel() -> bool:
    ip = _ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def show_result(res: "CellResult") -> None:
    """Display stdout/stderr, rich outputs and results of a cell, grouped."""
    world = len(res.ranks)
    oc = res.outcomes
    if not res.streamed:
        text = render_streams({r: oc[r].stdout for r in res.ranks}, world)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
        err = render_streams({r: oc[r].stderr for r in res.ranks}, world)
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()
    _show_rich(res)


def _bundle_key(content: dict) -> str:
    try:
        return json.dumps(content.get("data", {}), sort_keys=True, default=str)
    except Exception:
        return repr(content)


def _show_rich(res: "CellResult") -> None:
    world = len(res.ranks)
    oc = res.outcomes
    ip = _ipython()
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

    def __init__(self, cluster, ars: dict, delay_s: float = 1.0, min_interval_s: float = 0.25):
        self.cluster = cluster
        self.ars = ars
        self.t0 = time.monotonic()
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.started = False
        self._last = 0.0
        self._printed: dict[int, int] = {r: 0 for r in ars}
        self._handle = None
        self._kernel = in_kernel()

    def _texts(self) -> dict[int, str]:
        out = {}
        for r, ar in self.ars.items():
            try:
                md = ar.metadata
                md = md[0] if isinstance(md, list) else md
                out[r] = (md.get("stdout") or "") + (md.get("stderr") or "")
            except Exception:
                out[r] = ""
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

    def _show_kernel(self, texts: dict[int, str]) -> None:
        from IPython.display import display

        world = len(texts)
        body = render_streams(texts, world) or "(running...)"
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
            self._show_kernel(texts)
        else:
            for r, text in texts.items():
                rest = text[self._printed[r]:]
                if rest:
                    for line in rest.splitlines():
                        sys.stdout.write(f"[rank {r}] {line}\n")
                    self._printed[r] = len(text)
            sys.stdout.flush()
