"""Dashboard (``%dp dashboard``): cluster status, live step / loss / throughput, memory per rank.

Who talks to whom: while ``%dp train`` runs, the engines are busy, so the
dashboard never sends them anything then.  Training started with
``publish=True`` sends a small progress dict from every rank through
ipyparallel's data channel (``datapub``, at most ~5 per second); the
notebook's ipyparallel client stores it in its ``metadata`` as messages
arrive (on its own I/O thread).  The dashboard subscribes to the session's
progress events (:meth:`ViewSource.subscribe`: each one decoded once,
:mod:`dpnb.core.events`) and its poller thread also *reads* the published
progress (a cell that calls ``train`` itself has no session call), so it
updates while the notebook's main thread waits for the training call.  When the cluster is idle, the "refresh" button (main thread) asks
every rank for ``%dp status`` and its last records
(``dpnb.engine.metrics.views.live_summary``; no collective).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as w

from ..core.viewsource import ViewSource
from ..display import GROUP_ABOVE, byte_span, group_cells, group_status
from dpnb.engine import entrypoints as ep
from ..progress import progress_from_client  # noqa: F401  (the decoder the session uses)
from . import _common as C

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DashboardView:
    """What the dashboard shows (all optional: a part with no data is left out)."""

    status: tuple[dict, ...] = ()
    progress: dict = field(default_factory=dict)  # rank -> latest progress payload
    history: tuple[tuple[int, float, float | None], ...] = ()  # (step, loss, samples/s)
    memory: tuple[dict, ...] = ()  # per rank: rank, rss_bytes, cuda_allocated, state_bytes
    strategy: str | None = None
    running: bool = False

    @property
    def last(self) -> dict | None:
        if self.progress:
            return self.progress[min(self.progress)]
        return None


def data(status: list[dict] | None = None, summaries: list[dict] | None = None,
         progress: dict | None = None, history: list | None = None, running: bool = False) -> DashboardView:
    """Combine ``cluster.status()`` rows, each rank's ``live_summary`` and datapub progress."""
    hist: dict[int, tuple[int, float, float | None]] = {}
    strategy = None
    mem: dict[int, dict] = {}
    for row in status or []:
        mem[row["rank"]] = {"rank": row["rank"], "rss_bytes": row.get("rss_bytes"),
                            "cuda_allocated": row.get("cuda_allocated"), "state_bytes": None}
    for s in summaries or []:
        strategy = s.get("strategy", strategy)
        if s.get("rank") == 0 or not hist:
            for step, loss, sps in s.get("history") or []:
                hist[int(step)] = (int(step), float(loss), sps)
        last = s.get("last") or {}
        b = last.get("bytes") if isinstance(last, dict) else None
        m = mem.setdefault(s["rank"], {"rank": s["rank"], "rss_bytes": None, "cuda_allocated": None})
        m["state_bytes"] = b.get("total") if b else None
    for step, loss, *rest in history or []:
        hist[int(step)] = (int(step), float(loss), rest[0] if rest else None)
    prog = dict(progress or {})
    for p in prog.values():
        for step, loss, *sps in p.get("history") or []:  # (step, loss[, samples/s])
            old = hist.get(int(step))
            hist[int(step)] = (int(step), float(loss), sps[0] if sps else (old[2] if old else None))
        if p.get("step") is not None and p.get("samples_per_s") is not None:
            st = int(p["step"])
            hist[st] = (st, float(p.get("loss", hist.get(st, (0, float("nan")))[1])), p["samples_per_s"])
    return DashboardView(tuple(status or ()), prog, tuple(hist[k] for k in sorted(hist)),
                         tuple(mem[k] for k in sorted(mem)), strategy, bool(running))


# ----------------------------------------------------------------- output
STATUS_HEADERS = ("rank", "host", "pid", "device", "backend", "alive", "state", "host RSS", "GPU allocated",
                  "model states")


def _grouped_status_rows(d: DashboardView) -> list[list[str]]:
    """One row per host and health state, ranks as ranges and memory as min-max:
    at 32 ranks only the ranks that differ (dead, busy, another host) stand out."""
    mem = {m["rank"]: m for m in d.memory}
    rows = []
    for rs in group_status(list(d.status)):
        rows.append(group_cells(rs) + [
                     byte_span([r.get("rss_bytes") for r in rs], binary=True),
                     byte_span([r.get("cuda_allocated") for r in rs], binary=True),
                     byte_span([mem.get(r["rank"], {}).get("state_bytes") for r in rs])])
    return rows


def status_headers(d: DashboardView) -> tuple[str, ...]:
    return STATUS_HEADERS if len(d.status) <= GROUP_ABOVE else ("ranks", "host", "engines") + STATUS_HEADERS[3:]


def status_rows(d: DashboardView) -> list[list[str]]:
    if len(d.status) > GROUP_ABOVE:
        return _grouped_status_rows(d)
    mem = {m["rank"]: m for m in d.memory}
    rows = []
    for r in d.status:
        m = mem.get(r["rank"], {})
        rows.append([str(r["rank"]), str(r.get("host", "")), str(r.get("pid", "")), str(r.get("device", "")),
                     str(r.get("backend", "")), "yes" if r.get("alive", True) else "NO", str(r.get("state", "")),
                     C.fmt_bytes(r.get("rss_bytes"), binary=True), C.fmt_bytes(r.get("cuda_allocated"), binary=True),
                     C.fmt_bytes(m.get("state_bytes"))])
    return rows


def _summary(d: DashboardView) -> list[str]:
    lines = []
    if d.status:
        alive = sum(1 for r in d.status if r.get("alive", True))
        lines.append(f"{len(d.status)} ranks, {alive} alive" + (f", {d.strategy}" if d.strategy else ""))
    p = d.last
    if p:
        thr = f", {p['samples_per_s']:,.1f} samples/s" if p.get("samples_per_s") else ""
        tok = f", {p['tokens_per_s']:,.0f} tokens/s" if p.get("tokens_per_s") else ""
        lines.append(f"{'training' if d.running else 'last run'}: step {p.get('step')} "
                     f"({p.get('done', '?')}/{p.get('total', '?')}), loss {p.get('loss', float('nan')):.4g}{thr}{tok}")
    elif d.history:
        s, loss, sps = d.history[-1]
        lines.append(f"last recorded step {s}: loss {loss:.4g}" + (f", {sps:,.1f} samples/s" if sps else ""))
    else:
        lines.append("no training yet: run %dp train (with publish=True for live updates)")
    if d.history:
        lines.append(f"loss curve: {len(d.history)} steps ({d.history[0][0]}-{d.history[-1][0]})")
    return lines


def text(d: DashboardView) -> str:
    out = ["dpnb dashboard"] + ["  " + s for s in _summary(d)]
    if d.status:
        out += ["", C.text_table(status_headers(d), status_rows(d))]
    return "\n".join(out)


def html(d: DashboardView) -> str:
    out = C.html_lines(_summary(d))
    if d.status:
        out += C.html_table(status_headers(d), status_rows(d), "Cluster status",
                            highlight=lambda i: not d.status[i].get("alive", True))
    return out


def figure(d: DashboardView):
    """Loss vs step, samples/s vs step, memory per rank (host RSS and model-state bytes)."""
    fig = C.new_figure(3.6)
    ax, ax2, ax3 = fig.subplots(1, 3)
    if d.history:
        steps = [h[0] for h in d.history]
        ax.plot(steps, [h[1] for h in d.history], "-", color=C.COLORS["backward"], lw=1.5)
        thr = [(h[0], h[2]) for h in d.history if h[2]]
        if thr:
            ax2.plot([t[0] for t in thr], [t[1] for t in thr], "-", color=C.COLORS["all_reduce"], lw=1.2)
    else:
        for a in (ax, ax2):
            a.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=a.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global mean)")
    ax.set_title("Loss", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax2.set_xlabel("step")
    ax2.set_ylabel("throughput (samples/s)")
    ax2.set_title("Throughput", fontsize=10)
    ax2.grid(True, alpha=0.3)
    if d.memory:
        ranks = [m["rank"] for m in d.memory]
        rss = [m.get("rss_bytes") or 0 for m in d.memory]
        gpu = [m.get("cuda_allocated") or 0 for m in d.memory]
        state = [m.get("state_bytes") or 0 for m in d.memory]
        series = [("host RSS", rss, "#8C8C8C"), ("GPU allocated", gpu, C.COLORS["grads"]),
                  ("model states", state, C.COLORS["params"])]
        series = [s for s in series if any(s[1])]
        vals_all = [v for s in series for v in s[1] if v]
        top = max(vals_all or [1])
        wide = bool(vals_all) and top / min(vals_all) > 50
        # Linear axes are drawn in the display unit itself, so the tick
        # locator picks round numbers of MiB/GiB (not 47.6837 MiB).
        div, unit = (1.0, "B") if wide else C.byte_scale(top, binary=True)
        w = 0.8 / max(1, len(series))
        many = len(ranks) > GROUP_ABOVE  # label only each series' largest bar, tick every k-th rank
        for k, (name, vals, col) in enumerate(series):
            xs = [r - 0.4 + w * (k + 0.5) for r in range(len(ranks))]
            ax3.bar(xs, [v / div for v in vals], w * 0.95, color=col, label=name)
            top_i = max(range(len(vals)), key=lambda i: vals[i])
            for i, (x, v) in enumerate(zip(xs, vals)):
                if v and (not many or i == top_i):
                    ax3.text(x, v / div, C.fmt_bytes(v, binary=True, digits=3)
                             + (f"\n(rank {ranks[i]})" if many else ""), ha="center", va="bottom", fontsize=6.5)
        # a dead rank's last memory is history: mark it where its bar stands
        dead = {st.get("rank") for st in d.status if not st.get("alive", True)}
        for i in (i for i, r in enumerate(ranks) if r in dead):
            ax3.plot([i], [0], marker="x", color="#C0392B", markersize=9, clip_on=False)
            ax3.text(i, top / div * 1.08 if not wide else top * 2, f"rank {ranks[i]} dead",
                     ha="center", va="bottom", fontsize=6.5, color="#C0392B")
        if many:
            step = -(-len(ranks) // 8)
            ax3.set_xticks(range(0, len(ranks), step))
            ax3.set_xticklabels([str(r) for r in ranks[::step]], fontsize=8)
            ax3.set_xlabel("rank")
        else:
            ax3.set_xticks(range(len(ranks)))
            ax3.set_xticklabels([f"rank {r}" for r in ranks], fontsize=8)
        if wide:
            ax3.set_yscale("log")
            ax3.set_ylim(min(vals_all) / 3, top * 8)
            ax3.set_ylabel("memory (bytes, log)")
        else:
            ax3.set_ylim(0, top / div * 1.2)
            ax3.set_ylabel(f"memory ({C.unit_note(unit)})")
        if series:
            ax3.legend(fontsize=7, loc="upper left")
    else:
        ax3.text(0.5, 0.5, "no status yet", ha="center", va="center", transform=ax3.transAxes)
    ax3.set_title("Memory per rank", fontsize=10)
    ax3.grid(True, axis="y", alpha=0.3)
    fig.suptitle(" | ".join(_summary(d)), fontsize=9)
    return fig


# ----------------------------------------------------------------- widget
def collect(cluster: ViewSource) -> tuple[list[dict], list[dict]]:
    """``cluster.status()`` and every rank's ``live_summary`` (main thread, cluster idle)."""
    status = cluster.status()
    try:
        summ = C.call_ok(cluster, ep.LIVE_SUMMARY)
    except C.ViewError:
        summ = []
    return status, summ


def _step(p: dict) -> int:
    return p["step"] if p.get("step") is not None else -1


class _Poller:
    """Background thread: re-reads datapub progress every ``interval`` s and refreshes the view.

    It writes the shared ``state`` only under ``lock`` (the view reads it
    under the same lock), and a failed refresh is logged and retried on the
    next tick rather than ending the thread: a dashboard that silently stops
    at step 0 is worse than one that skips a frame.
    """

    def __init__(self, box, cluster: ViewSource, state, lock, interval: float):
        self.box, self.cluster, self.state, self.lock = box, cluster, state, lock
        self.interval = interval
        self.stop_evt = threading.Event()
        self.tick_lock = threading.Lock()  # the poller thread and catch_up() alternate
        self.thread = threading.Thread(target=self.run, name="dpnb-dashboard", daemon=True)
        self.last_sig: tuple | None = None
        self.seen: dict = {}
        self.final_seen: object = None
        # the latest event per rank the session handed over, merged at the next tick
        self.pushed: dict[int, dict] = {}
        self.pushed_lock = threading.Lock()  # the session's thread writes, the poller reads
        self.unsubscribe = cluster.subscribe(self.on_event)

    def on_event(self, ev) -> None:
        """A progress event from the session (its thread): kept for the next tick."""
        with self.pushed_lock:
            self.pushed[ev.rank] = ev.as_dict()

    def run(self) -> None:
        try:
            while not self.stop_evt.wait(self.interval):
                stopped = not self.cluster.running
                self.safe_tick()  # once more after a stop: the run's end is still in memory
                if stopped:
                    break
        finally:
            self.unsubscribe()

    def safe_tick(self) -> None:
        try:
            with self.tick_lock:
                self.tick()
        except Exception as e:  # keep following training; say why a frame was lost
            log.warning("dashboard refresh failed: %s: %s", type(e).__name__, e, exc_info=True)

    def tick(self) -> None:
        running = self.cluster.in_flight()
        prog = self.cluster.published_progress(self.seen)
        with self.pushed_lock:
            pushed, self.pushed = self.pushed, {}
        for r, p in pushed.items():
            if r not in prog or _step(p) >= _step(prog[r]):
                prog[r] = p
        # The payloads a finished %dp train kept (dpnb.session.verbs): authoritative
        # for the end of the run even when no tick fell inside it.
        last = self.cluster.last_run()
        final = last.progress if last is not None else None
        if final and final is not self.final_seen:
            self.final_seen = final
            for r, p in final.items():
                if r not in prog or _step(p) >= _step(prog[r]):
                    prog[r] = p
        for mid in list(self.seen)[:-16]:  # only the latest runs matter
            del self.seen[mid]
        sig = tuple(sorted((r, p.get("step"), p.get("done")) for r, p in prog.items()))
        changed = bool(prog) and sig != self.last_sig
        if not changed and self.state.get("running") == running:
            return
        with self.lock:
            if changed:
                self.state["progress"].update(prog)
                for p in prog.values():
                    for step, loss, *sps in p.get("history") or []:
                        # each step's own samples/s (older payloads carry none)
                        self.state["history"][int(step)] = [int(step), float(loss),
                                                            sps[0] if sps else None]
            self.state["running"] = running
        self.last_sig = sig
        self.box.refresh()


def view(cluster: ViewSource | None = None, *, status: list[dict] | None = None, summaries: list[dict] | None = None,
         progress: dict | None = None, interval: float = 0.5, live: bool = True):
    """The dashboard widget.  With ``cluster``: status and summaries fetched now,
    a refresh button, and (``live=True``) a poller that follows training
    started with ``publish=True``.  ``box.stop()`` ends the poller."""

    state: dict[str, Any] = {"status": status or [], "summaries": summaries or [], "progress": dict(progress or {}),
                             "history": {}, "running": False}
    if cluster is not None and status is None:
        state["status"], state["summaries"] = collect(cluster)
    lock = threading.RLock()  # guards ``state`` and the redraw

    def compute(_v: dict) -> DashboardView:
        with lock:
            return data(state["status"], state["summaries"], dict(state["progress"]),
                        list(state["history"].values()), state["running"])

    refresh_btn = w.Button(description="refresh", tooltip="status + last records from every rank (when idle)")
    extra = [refresh_btn] if cluster is not None else []
    box = C.viewbox("dpnb dashboard", {}, compute, figure, html, text, extra=extra)
    plain_refresh = box.refresh

    def locked_refresh() -> None:
        with lock:
            plain_refresh()

    box.refresh = locked_refresh  # type: ignore[method-assign]
    box.poller = None
    if cluster is not None:
        def on_refresh(_b):
            if cluster.in_flight():
                box.message.value = "<i>training is running: the status refreshes when it is done</i>"
                return
            status, summaries = collect(cluster)
            with lock:
                state["status"], state["summaries"] = status, summaries
            box.refresh()

        refresh_btn.on_click(on_refresh)
        if live:
            box.poller = _Poller(box, cluster, state, lock, interval)
            box.poller.thread.start()

    def stop() -> None:
        if box.poller is not None:
            box.poller.stop_evt.set()

    def catch_up() -> None:
        """Show the latest state now (``%dp train`` calls this when it returns)."""
        if box.poller is not None:
            box.poller.safe_tick()

    box.stop = stop
    box.catch_up = catch_up
    return box


def show(cluster: ViewSource | None = None, **kw: Any):
    """Display the dashboard; returns the widget (``.stop()`` ends its poller) in a kernel."""
    if C._in_kernel():
        box = view(cluster, **kw)
        C.show_view(box)
        return box
    else:
        if cluster is not None:
            status, summ = collect(cluster)
            kw.setdefault("status", status)
            kw.setdefault("summaries", summ)
        print(text(data(kw.get("status"), kw.get("summaries"), kw.get("progress"))))
        return None


def save(path: str, cluster: ViewSource | None = None, **kw: Any) -> str:
    if cluster is not None:
        status, summ = collect(cluster)
        kw.setdefault("status", status)
        kw.setdefault("summaries", summ)
    return C.save_figure(figure(data(kw.get("status"), kw.get("summaries"), kw.get("progress"))), path)

