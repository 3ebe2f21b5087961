"""Small renderers for notebook-side tables (a widget in Jupyter, text elsewhere)."""

from __future__ import annotations

import html

from .core.units import fmt_bytes
from .env import in_kernel

STATUS_COLUMNS = ("rank", "host", "pid", "device", "backend", "alive", "state", "memory")


def _fmt_bytes(n) -> str:
    return fmt_bytes(n, binary=True)


def status_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        mem = _fmt_bytes(r.get("rss_bytes"))
        if r.get("cuda_allocated") is not None:
            mem += f" (GPU {_fmt_bytes(r['cuda_allocated'])})"
        out.append([str(r["rank"]), r["host"], str(r["pid"]), r["device"], r["backend"],
                    "yes" if r["alive"] else "NO", str(r["state"]), mem])
    return out


def status_text(rows: list[dict]) -> str:
    table = [list(STATUS_COLUMNS)] + status_rows(rows)
    widths = [max(len(row[i]) for row in table) for i in range(len(STATUS_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def status_widget(rows: list[dict]):
    import ipywidgets as w

    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{c}</th>" for c in STATUS_COLUMNS)
    body = []
    for row, raw in zip(status_rows(rows), rows):
        style = "" if raw["alive"] else " style='background:#fdd'"
        cells = "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in row)
        body.append(f"<tr{style}>{cells}</tr>")
    return w.HTML(f"<table class='dpnb-status'><thead><tr>{head}</tr></thead>"
                  f"<tbody>{''.join(body)}</tbody></table>")


def show_status(rows: list[dict]) -> None:
    if in_kernel():
        from IPython.display import display

        display(status_widget(rows))
    else:
        print(status_text(rows))
