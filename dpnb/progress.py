"""Live training progress in the notebook (a widget) or a terminal (a line).

The engines publish a small dict after each step through ipyparallel's
``datapub`` (it rides the same channel as printed output, so it arrives while
the step loop is still running).  This module only renders what rank 0
published: step, loss, samples/s, tokens/s, and a loss curve that is redrawn
at most about once a second so drawing never slows training down.
"""

from __future__ import annotations

import io
import logging
import sys
import time

from .core.events import ProgressEvent, TrainSummary
from .display import show_widget, widget_bundle
from .env import RENDER_LOCK, in_kernel

log = logging.getLogger(__name__)


def _fmt_rate(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.1f}"


class TrainProgress:
    """Progress bar + live loss curve for ``Cluster.train``."""

    def __init__(self, total_steps: int | None, start_step: int = 0, *, kernel: bool | None = None,
                 redraw_s: float = 1.0):
        self.total = total_steps
        self.start_step = start_step
        self.kernel = in_kernel() if kernel is None else kernel
        self.redraw_s = redraw_s
        self.losses: list[tuple[int, float]] = []
        self._seen_step = -1
        self._last_draw = 0.0
        self._last_line = ""
        self.widget = None
        if self.kernel:
            self._build_widget()

    # ------------------------------------------------------------ widget
    def _build_widget(self) -> None:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        import ipywidgets as w

        self.bar = w.IntProgress(value=0, min=0, max=max(1, self.total or 1),
                                 description="step", bar_style="info",
                                 layout=w.Layout(width="60%"))
        self.label = w.HTML("starting...")
        self.curve = w.Image(format="png", layout=w.Layout(max_width="640px"))
        self.widget = w.VBox([w.HBox([self.bar, self.label]), self.curve],
                             layout=w.Layout(border="1px solid #ddd", padding="4px"))
        self.widget.add_class("dpnb-train-progress")
        # the progress line is the widget's text form: close() puts the last
        # one there, so a notebook run headless keeps it (not the widget's repr)
        self._handle = show_widget(self.widget, "starting...", display_id=True)

    def _curve_png(self) -> bytes:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 2.6), dpi=100)
        ax = fig.add_subplot()
        if self.losses:
            xs, ys = zip(*self.losses)
            ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, ms=3, color="C0")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (global batch mean)")
        ax.set_title("training loss (live)")
        ax.grid(alpha=0.3)
        buf = io.BytesIO()
        with RENDER_LOCK:
            fig.tight_layout()
            fig.savefig(buf, format="png")
        return buf.getvalue()

    # ------------------------------------------------------------ updates
    def update(self, ev: ProgressEvent | None, force: bool = False) -> None:
        """Take rank 0's latest progress event (or None if nothing new)."""
        if ev is not None and ev.step is not None and ev.step != self._seen_step:
            self._seen_step = ev.step
            # ``history`` holds the recent steps (publishing
            # is rate-limited on the engine), so the curve misses no step.
            hist = ev.history or [(ev.step, ev.loss)]
            known = self.losses[-1][0] if self.losses else -1
            for step, loss, *_sps in hist:  # (step, loss[, samples/s])
                if loss is not None and int(step) > known:
                    self.losses.append((int(step), float(loss)))
            self._render(ev)
        now = time.monotonic()
        if self.kernel and self.losses and (force or now - self._last_draw > self.redraw_s):
            self._last_draw = now
            self.curve.value = self._curve_png()

    def _done(self, ev: ProgressEvent) -> int:
        if ev.done is not None:
            return int(ev.done)
        return int(ev.step or 0) - self.start_step + 1

    def _text(self, ev: ProgressEvent) -> str:
        done = self._done(ev)
        total = ev.total or self.total
        total = f"/{total}" if total else ""
        taken = int(ev.step) + 1 if ev.step is not None else None
        parts = [f"step {done}{total}" + (f" ({taken} in total)" if taken and taken != done else ""),
                 f"loss {ev.loss:.4f}" if ev.loss is not None else "loss -",
                 f"{_fmt_rate(ev.samples_per_s)} samples/s",
                 f"{_fmt_rate(ev.tokens_per_s)} tokens/s"]
        return " | ".join(parts)

    def _render(self, ev: ProgressEvent) -> None:
        text = self._text(ev)
        if self.kernel:
            done = self._done(ev)
            if ev.total:
                self.bar.max = int(ev.total)
            self.bar.value = min(self.bar.max, max(0, done))
            self.label.value = f"<code>{text}</code>"
            self._last_line = text
        else:
            self._last_line = text
            sys.stdout.write("\r" + text.ljust(90))
            sys.stdout.flush()

    def close(self, summary: TrainSummary | None, note: str = "") -> None:
        if summary:
            last = summary.progress_event()
            if last.step is not None and last.step != self._seen_step:
                self.update(last)
        if self.kernel:
            self.update(None, force=True)
            self.bar.bar_style = "warning" if note else "success"
            if note:
                self.label.value += f" <b>{note}</b>"
            line = " ".join(x for x in (self._last_line, note) if x)
            self._handle.update(widget_bundle(self.widget, line or "no step ran"), raw=True)
        else:
            if self._last_line or note:
                sys.stdout.write("\n" if self._last_line else "")
            if note:
                sys.stdout.write(note + "\n")
            sys.stdout.flush()


def _step(p: dict) -> int:
    return p["step"] if p.get("step") is not None else -1


def progress_from_client(client, also: dict | None = None) -> dict:
    """Latest progress payload per rank (:class:`~dpnb.core.events.ProgressEvent`, as the
    plain dict views read) from in-flight ipyparallel requests (read-only).

    ``also``: message ids seen earlier; their final payload is kept in the
    client's metadata after they finish, so a run shorter than the polling
    interval still shows its last step.  Ids that carried progress are added
    to ``also`` (a dict used as an insertion-ordered set).
    """
    out: dict = {}
    # The client's I/O thread adds and removes ids meanwhile: copy, retrying
    # the rare "changed size during iteration".
    for _ in range(3):
        try:
            ids = list(client.outstanding) + list(also or ())
            break
        except RuntimeError:  # "changed size during iteration": read it again
            continue
    else:
        log.info("outstanding ids kept changing; progress read next time")
        return out
    for mid in ids:
        md = client.metadata.get(mid)
        ev = ProgressEvent.decode(md.get("data") if md is not None else None)
        if ev is not None:
            if also is not None:
                also[mid] = None
            p = ev.as_dict()
            if ev.rank not in out or _step(p) >= _step(out[ev.rank]):
                out[ev.rank] = p
    return out
