"""Shared plumbing of the views: figures, tables, units, the widget shell, show/save.

Every view is four layers, each usable alone:

``data(...)``
    a frozen dataclass with everything shown (bars, segments, table rows,
    labels), computed from :mod:`dpnb.core` and the engines' records;
``figure(data)``
    a :class:`matplotlib.figure.Figure` built without pyplot (Agg, no global
    state), ~9.5 in wide at 100 dpi: readable at notebook width;
``text(data)``
    the terminal summary;
``view(...)``
    an ipywidgets widget (a :class:`ViewBox`): controls whose observers
    recompute ``data`` from the core, the figure as a PNG image, HTML
    readouts.  ``show(...)`` displays it in a kernel together with a static
    HTML/PNG copy that is updated as the controls move (so a saved notebook
    and nbconvert/HTML keep the last figure), and prints ``text`` in a
    terminal.  ``save(path, ...)`` writes PNG or SVG.
"""

from __future__ import annotations

import base64
import html as _html
import io
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as w
from IPython.display import display
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from dpnb.core import ConfigError
from dpnb.display import show_widget
from dpnb.env import RENDER_LOCK, in_kernel

from ..core.errors import ViewError  # one class for every view, engine side and notebook side

FIG_WIDTH_IN = 9.5
DPI = 100

#: One colour per model-state part / timeline kind, used by every view.
COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "grad_accum": "#937860",
    "master_weights": "#55A868",
    "optimizer_moments": "#C44E52",
    "optimizer": "#C44E52",
    "forward": "#8C8C8C",
    "backward": "#4C72B0",
    "all_reduce": "#DD8452",
    "all_reduce_alt": "#F2B880",
    "reduce_scatter": "#C44E52",
    "all_gather": "#55A868",
    "optimizer_step": "#8172B3",
    "exposed": "#D62728",
    "wait": "#E0E0E0",
    "model": "#4C72B0",
    "measured": "#DD8452",
}


# ----------------------------------------------------------------- figures
def new_figure(height_in: float, width_in: float = FIG_WIDTH_IN, **kw: Any) -> Figure:
    """A pyplot-free Figure with an Agg canvas and constrained layout."""

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def fig_bytes(fig: Figure, fmt: str = "png") -> bytes:
    """The figure encoded as PNG or SVG bytes."""
    buf = io.BytesIO()
    with RENDER_LOCK:  # Agg's font cache is shared by every figure of the process
        fig.savefig(buf, format=fmt, dpi=DPI)
    return buf.getvalue()


def save_figure(fig: Figure, path: str) -> str:
    """Write ``fig`` to ``path``; the extension picks the format (.png or .svg)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in ("png", "svg"):
        raise ViewError(f"save to a .png or .svg path, got {path!r}")
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "wb") as f:
        f.write(fig_bytes(fig, ext))
    return path


def broken_barh_segments(ax) -> list[list[tuple[float, float]]]:
    """(start, width) of every broken_barh collection on ``ax`` (for tests)."""

    out = []
    for coll in ax.collections:
        if isinstance(coll, PolyCollection) and getattr(coll, "_dpnb_segments", None) is not None:
            out.append(list(coll._dpnb_segments))
    return out


def barh(ax, segments: Sequence[tuple[float, float]], y: float, height: float = 0.7, **kw):
    """``ax.broken_barh`` remembering its (start, width) list for tests."""
    segs = [(float(s), float(w)) for s, w in segments]
    coll = ax.broken_barh(segs, (y - height / 2, height), **kw)
    coll._dpnb_segments = segs
    return coll


# ------------------------------------------------------------------- units
# Byte and time formatting live in the pure core (one copy for every layer).
from dpnb.core.units import (  # noqa: E402,F401
    byte_scale,
    fmt_bytes,
    fmt_count,
    fmt_ms,
    fmt_signed_bytes,
    unit_note,
)


def log_sizes(lo: float, hi: float, k: int) -> list[int]:
    """``k`` byte sizes spaced evenly in log between ``lo`` and ``hi`` (ints)."""
    if k < 2:
        return [int(lo)]
    a, b = math.log10(lo), math.log10(hi)
    return [int(round(10 ** (a + (b - a) * i / (k - 1)))) for i in range(k)]


# ------------------------------------------------------------------ tables
def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "",
               highlight: Callable[[int], bool] | None = None) -> str:
    head = "".join(f"<th style='text-align:right;padding:2px 8px'>{_html.escape(str(h))}</th>"
                   for h in headers)
    body = []
    for i, row in enumerate(rows):
        style = " style='background:#fff3cd'" if highlight and highlight(i) else ""
        cells = "".join(f"<td style='text-align:right;padding:2px 8px'>{_html.escape(str(c))}</td>"
                        for c in row)
        body.append(f"<tr{style}>{cells}</tr>")
    cap = f"<caption style='text-align:left;font-weight:bold'>{_html.escape(caption)}</caption>" if caption else ""
    return (f"<table class='dpnb-view' style='border-collapse:collapse;font-size:12px'>{cap}"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    table = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def html_lines(lines: Sequence[str], warn: Sequence[str] = ()) -> str:
    out = "".join(f"<div>{_html.escape(s)}</div>" for s in lines)
    out += "".join(f"<div style='color:#a15c00'>⚠ {_html.escape(s)}</div>" for s in warn)
    return f"<div class='dpnb-readout' style='font-size:13px'>{out}</div>"


# ------------------------------------------------------------- widget shell
def _in_kernel() -> bool:
    return in_kernel()


def static_bundle(fig: Figure, html_body: str, text: str) -> dict:
    """A display bundle that needs no widget state: HTML with the PNG inlined, PNG, text."""
    png = fig_bytes(fig, "png")
    b64 = base64.b64encode(png).decode("ascii")
    img = f"<img src='data:image/png;base64,{b64}' style='max-width:100%'/>"
    return {"text/html": f"<div class='dpnb-static'>{img}{html_body}</div>",
            "image/png": b64, "text/plain": text}


class ViewBox:  # placeholder for type checkers; viewbox() builds the real class on first use
    pass


def _make_viewbox_class():
    class _ViewBox(w.VBox):
        """A view: controls, the figure (PNG), HTML readouts.

        ``.controls`` maps names to the control widgets; ``.data`` holds the
        last computed data object; ``.figure`` the last Figure; ``.image`` /
        ``.readout`` / ``.message`` the output widgets; ``.refresh()``
        recomputes from the controls.  A ConfigError from the core (an
        impossible configuration) is shown in ``.message`` and the last good
        figure stays.
        """

        def __init__(self, title: str, controls: dict, compute: Callable[[dict], Any],
                     figure: Callable[[Any], Figure], html_fn: Callable[[Any], str],
                     text_fn: Callable[[Any], str], extra: Sequence[Any] = (),
                     show_figure: bool = True, layout_rows: Sequence[Sequence[str]] | None = None):
            self.title = title
            self.title_html = w.HTML(f"<b>{_html.escape(title)}</b>")
            self.controls = dict(controls)
            self._compute = compute
            self._figure_fn = figure
            self._html_fn = html_fn
            self._text_fn = text_fn
            self.image = w.Image(format="png", layout=w.Layout(max_width="100%"))
            self.readout = w.HTML()
            self.message = w.HTML()
            self.data = None
            self.figure = None
            self.error: str | None = None
            self._handles: list = []
            if layout_rows:
                rows = [w.HBox([self.controls[n] for n in row if n in self.controls]) for row in layout_rows]
                placed = {n for row in layout_rows for n in row}
                rest = [c for n, c in self.controls.items() if n not in placed]
                if rest:
                    rows.append(w.HBox(rest))
            else:
                ctl = list(self.controls.values())
                rows = [w.HBox(ctl[i:i + 3]) for i in range(0, len(ctl), 3)]
            body = [self.title_html, *rows, *extra, self.message]
            if show_figure:
                body.append(self.image)
            body.append(self.readout)
            super().__init__(body)
            for c in self.controls.values():
                if hasattr(c, "value"):
                    c.observe(self._on_change, names="value")
            self.refresh()

        def values(self) -> dict:
            return {n: c.value for n, c in self.controls.items() if hasattr(c, "value")}

        def _on_change(self, _change=None) -> None:
            self.refresh()

        def refresh(self) -> None:
            try:
                data = self._compute(self.values())
            except (ConfigError, ViewError) as e:
                self.error = str(e)
                self.message.value = (f"<div style='color:#b00020'>⚠ {_html.escape(str(e))}</div>")
                return
            self.error = None
            self.message.value = ""
            self.data = data
            fig = self._figure_fn(data)
            self.figure = fig
            self.image.value = fig_bytes(fig, "png")
            self.readout.value = self._html_fn(data)
            for h in self._handles:
                h.update(static_bundle(fig, self.readout.value, self._text_fn(data)), raw=True)

        def text(self) -> str:
            return self._text_fn(self.data) if self.data is not None else (self.error or "")

        def attach_static(self, handle) -> None:
            """Keep an IPython display handle updated with the static copy."""
            self._handles.append(handle)

    return _ViewBox


_VIEWBOX = None


def viewbox(*args: Any, **kw: Any):
    """Build a :class:`ViewBox` (the class is built on first use)."""
    global _VIEWBOX
    if _VIEWBOX is None:
        _VIEWBOX = _make_viewbox_class()
    return _VIEWBOX(*args, **kw)


def show_view(box, data: Any = None, fig: Figure | None = None, text: str | None = None) -> None:
    """Show a view: the widget and an updating static copy in a kernel, text elsewhere.

    The static copy (HTML with the PNG inlined, plus image/png and
    text/plain) needs no widget state, so it survives saving the notebook,
    nbconvert and a kernel restart; the widget's observers update it.
    """
    if _in_kernel():
        if box is not None:
            # the static copy below shows the figure and the tables, kept up to
            # date by the controls; showing them in the widget too would
            # print everything twice
            box.image.layout.display = "none"
            box.readout.layout.display = "none"
            # its text form names it; the static copy below carries the text
            show_widget(box, f"{box.title} (controls shown in Jupyter; the figure and text below)")
            bundle = static_bundle(box.figure, box.readout.value, box.text())
            handle = display(bundle, raw=True, display_id=True)
            box.attach_static(handle)
        else:
            display(static_bundle(fig, "", text or ""), raw=True)
    else:
        print(text if text is not None else box.text())


def show_static(d: Any, figure: Callable, html: Callable, text: Callable) -> None:
    """A view without controls: in a kernel the figure with the HTML tables and
    the text (no widget state, so it survives saving); elsewhere the text only,
    without drawing the figure."""
    if _in_kernel():
        display(static_bundle(figure(d), html(d), text(d)), raw=True)
    else:
        print(text(d))


def int_slider(desc: str, value: int, lo: int, hi: int, step: int = 1, width: str = "300px"):
    return w.IntSlider(value=value, min=lo, max=max(hi, value), step=step, description=desc,
                       continuous_update=False, style={"description_width": "110px"},
                       layout=w.Layout(width=width))


def float_slider(desc: str, value: float, lo: float, hi: float, step: float, width: str = "300px",
                 fmt: str = ".3g"):
    return w.FloatSlider(value=value, min=lo, max=max(hi, value), step=step, description=desc,
                         continuous_update=False, readout_format=fmt,
                         style={"description_width": "110px"}, layout=w.Layout(width=width))


def log_slider(desc: str, value: float, lo_exp: float, hi_exp: float, step: float = 0.1,
               width: str = "300px", fmt: str = ".3g"):
    value = min(max(value, 10 ** lo_exp), 10 ** hi_exp)
    return w.FloatLogSlider(value=value, base=10, min=lo_exp, max=hi_exp, step=step, description=desc,
                            continuous_update=False, readout_format=fmt,
                            style={"description_width": "110px"}, layout=w.Layout(width=width))


def dropdown(desc: str, options: Sequence[Any], value: Any, width: str = "300px"):
    return w.Dropdown(options=list(options), value=value, description=desc,
                      style={"description_width": "110px"}, layout=w.Layout(width=width))


def float_text(desc: str, value: float, width: str = "300px"):
    return w.FloatText(value=value, description=desc, style={"description_width": "110px"},
                       layout=w.Layout(width=width))


def call_ok(cluster, dotted: str, *args: Any, ranks=None, **kw: Any) -> list:
    """``cluster.call`` that raises a clear ViewError with the first rank's error."""
    res = cluster.call(dotted, *args, ranks=ranks, raise_errors=False, **kw)
    if not res.ok:
        err = getattr(res, "error", None)
        for r in res.ranks:
            o = res.outcomes[r]
            if not o.ok:
                raise ViewError(f"{dotted} failed on rank {r}: {o.ename}: {o.evalue}".rstrip(": ")
                                + (f"\n{err}" if err is not None and not o.raised else ""))
    return res.values
