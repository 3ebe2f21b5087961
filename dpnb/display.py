"""Small renderers for notebook-side tables (a widget in Jupyter, text elsewhere)."""

from __future__ import annotations

import html

from .core.units import fmt_bytes
from .env import in_kernel
from .ranks import format_ranks, rank_label

STATUS_COLUMNS = ("rank", "host", "pid", "device", "backend", "alive", "state", "memory")


def _fmt_bytes(n) -> str:
    return fmt_bytes(n, binary=True)


#: above this many ranks, status tables group the ranks that agree
GROUP_ABOVE = 8


def group_status(rows: list[dict]) -> list[list[dict]]:
    """Status rows grouped by host, backend, health and state (first-seen order):
    at 32 ranks the ranks that differ -- dead, busy, another host -- stand out."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (str(r.get("host", "")), str(r.get("backend", "")), bool(r.get("alive", True)),
               str(r.get("state", "")))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def devices_label(devs: list[str]) -> str:
    """``cpu`` / ``cuda:0-7``: the devices of a group of ranks, compactly."""
    kinds = {d.split(":")[0] for d in devs}
    if len(kinds) == 1 and all(":" in d and d.split(":")[1].isdigit() for d in devs):
        return f"{kinds.pop()}:{format_ranks(int(d.split(':')[1]) for d in devs)}"
    return ",".join(sorted(set(devs)))


def byte_span(vals, **kw) -> str:
    """``400 MiB`` or ``400 MiB - 431 MiB`` over a group; ``-`` when none is known."""
    vals = [v for v in vals if v]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt_bytes(lo, **kw) if lo == hi else f"{fmt_bytes(lo, **kw)} - {fmt_bytes(hi, **kw)}"


def group_cells(rs: list[dict]) -> list[str]:
    """The cells a group of status rows shares: ranks, host, engines, devices,
    backend, alive, state (the key of :func:`group_status` and its spans)."""
    r0 = rs[0]
    return [rank_label(r["rank"] for r in rs), str(r0.get("host", "")),
            f"{len(rs)} engine{'s' if len(rs) > 1 else ''}",
            devices_label([str(r.get("device", "")) for r in rs]), str(r0.get("backend", "")),
            "yes" if r0.get("alive", True) else "NO", str(r0.get("state", ""))]


def _grouped_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for rs in group_status(rows):
        mem = byte_span([r.get("rss_bytes") for r in rs], binary=True)
        gpu = [r.get("cuda_allocated") for r in rs if r.get("cuda_allocated") is not None]
        if gpu:
            mem += f" (GPU {byte_span(gpu, binary=True)})"
        out.append(group_cells(rs) + [mem])
    return out


def status_rows(rows: list[dict]) -> list[list[str]]:
    if len(rows) > GROUP_ABOVE:
        return _grouped_rows(rows)
    out = []
    for r in rows:
        mem = _fmt_bytes(r.get("rss_bytes"))
        if r.get("cuda_allocated") is not None:
            mem += f" (GPU {_fmt_bytes(r['cuda_allocated'])})"
        out.append([str(r["rank"]), r["host"], str(r["pid"]), r["device"], r["backend"],
                    "yes" if r["alive"] else "NO", str(r["state"]), mem])
    return out


def status_columns(rows: list[dict]) -> tuple[str, ...]:
    return STATUS_COLUMNS if len(rows) <= GROUP_ABOVE else ("ranks", "host", "engines") + STATUS_COLUMNS[3:]


def host_order(rows: list[dict]) -> str:
    """``hosts in rank order: node-a: ranks 0-1, node-b: ranks 2-3`` ("" on one host)."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(rows, key=lambda r: r["rank"]):
        by_host.setdefault(str(r.get("host", "")), []).append(r["rank"])
    if len(by_host) < 2:
        return ""
    return "hosts in rank order: " + ", ".join(f"{h}: {rank_label(rs)}" for h, rs in by_host.items())


def status_text(rows: list[dict]) -> str:
    table = [list(status_columns(rows))] + status_rows(rows)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def widget_bundle(widget, text: str, html_text: str = "") -> dict:
    """``widget``'s display data with ``text`` as its ``text/plain`` (and
    ``html_text``, when given, as its ``text/html``).

    ipywidgets' own plain form is the widget's repr (``HTML(value="<table
    ...``): that is what a notebook run headless (nbconvert, papermill) keeps
    as its text, and what a text export or a terminal reader of the saved
    notebook shows.  The widget still renders in Jupyter (its view comes
    first); the text and HTML are the forms every other reader gets.
    """
    data = widget._repr_mimebundle_()
    if isinstance(data, tuple):  # (data, metadata) from some ipywidgets versions
        data = data[0]
    data = {**data, "text/plain": text}
    if html_text:
        data["text/html"] = html_text
    return data


def show_widget(widget, text: str, html_text: str = "", *, display_id: bool = False):
    """Display ``widget`` with a real plain-text (and HTML) form
    (:func:`widget_bundle`); the display handle when ``display_id``."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from IPython.display import display

    return display(widget_bundle(widget, text, html_text), raw=True, display_id=display_id)


def status_html(rows: list[dict]) -> str:
    """The status table as HTML (the widget's value, and the saved HTML form)."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{c}</th>" for c in status_columns(rows))
    body = []
    for row in status_rows(rows):
        style = "" if row[5] == "yes" else " style='background:#fdd'"
        cells = "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in row)
        body.append(f"<tr{style}>{cells}</tr>")
    order = host_order(rows)
    caption = f"<caption style='text-align:left'>{html.escape(order)}</caption>" if order else ""
    return (f"<table class='dpnb-status'>{caption}<thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def status_widget(rows: list[dict]):
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    import ipywidgets as w

    return w.HTML(status_html(rows))


def status_plain(rows: list[dict]) -> str:
    """The status table as text: what a terminal prints and a saved notebook keeps."""
    order = host_order(rows)
    return (order + "\n" if order else "") + status_text(rows)


def show_status(rows: list[dict]) -> None:
    if in_kernel():
        show_widget(status_widget(rows), status_plain(rows), status_html(rows))
    else:
        print(status_plain(rows))
