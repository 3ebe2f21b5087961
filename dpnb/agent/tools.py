"""The tools ``dpnb mcp`` serves, as plain functions of a :class:`dpnb.Cluster`.

Each answers what the matching ``%dp`` command shows, from the same
functions (``Cluster.status`` / ``where`` / ``last_failure``,
:mod:`dpnb.cluster.diagnose`, the views' ``data`` / ``fetch``,
:mod:`dpnb.session.resume`), as JSON-ready dicts instead of printed text.
Who talks to whom is theirs: ``status`` asks each idle rank over
ipyparallel (no collective), ``where`` knocks on every rank's side door
(answers while a rank is blocked in a collective), ``memory`` and
``batch_math`` ask the ranks for snapshots, ``run_code`` and the actions
go through the cluster's own verbs.  Nothing to report (no profile yet, no
failed cell) is an answer with ``available: false`` and why, not an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from .. import log as dlog
from ..cluster import diagnose
from ..cluster.status import status_rows
from ..cluster.types import Status
from ..core.errors import UserError
from dpnb.engine import entrypoints as ep
from ..ranks import parse_ranks
from ..session.resume import describe as describe_resume

log = logging.getLogger(__name__)


def _json_default(o):
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    return str(o)


def plain(value):
    """``value`` as JSON values (dataclasses as dicts, at any depth; tuples as lists;
    the rest as text)."""
    return json.loads(json.dumps(value, default=_json_default))


def _none(why: str) -> dict:
    return {"available": False, "why": why}


def status(c, running: str | None = None) -> dict:
    """``%dp status`` plus the cluster's identity and group state.  ``running``: the
    ranks run someone's call now (said in words), answered without asking the engines
    (:func:`dpnb.cluster.status.status_rows`), so it never queues behind the call."""
    if running is None:
        rows, busy = c.status(), sorted(c.busy)
    else:
        rows = status_rows(c, running)
        busy = [r for r in range(c.world_size) if r not in c.dead]
    out = {"cluster": c.cluster_id, "world_size": c.world_size, "backend": c.backend,
           "group_ok": c.group_ok, "generation": c.generation, "busy": busy,
           "dead": plain(c.dead), "ranks": plain(rows)}
    if running is not None:
        out["running"] = running
    return out


def train_live(c, live: dict, running: str) -> dict:
    """``train_progress`` while the ranks are busy: the session's train calls so far
    and the latest progress the running training published (rank 0's, step by step,
    as the notebook's own progress view hears it; no engine asked)."""
    st = c.training
    return {"steps_done": st.steps_done, "running": running, **plain(st.to_record()),
            "live": plain({str(r): ev for r, ev in sorted(live.items())})}


def where(c, ranks: str | None = None) -> dict:
    """``%dp where`` now (side doors), and where each rank was when the last failed
    cell was stopped (its rank, collective and line)."""
    out = {"now": c.where(ranks)}
    res = c.last_failure
    if res is None or not res.where:
        out["last_failure"] = _none("no failed cell on this cluster was stopped while ranks "
                                    "still ran (nothing to say where they were)")
    else:
        out["last_failure"] = {"verdict": diagnose.where_verdict(res),
                               "ranks": plain({str(r): a for r, a in res.where.items()})}
    return out


def _rank_failure(o) -> dict:
    line = diagnose.user_line(o.traceback)
    return {"status": str(o.status), "error": f"{o.ename}: {o.evalue}".strip(": "),
            "line": line, "collective_error": o.collective, "died": o.died, "note": o.note,
            "notes": list(o.notes)}


def last_error(c) -> dict:
    """The last failed cell or call: culprits, waiting ranks, each failing rank's error
    and line, where the ranks were, the report ``%%dp`` printed."""
    res = c.last_failure
    if res is None:
        return _none("no cell has failed since the cluster's holder took it up (a kept "
                     "cluster's failures in an earlier kernel are not kept with it)")
    d = diagnose.classify(res)
    err = res.error
    where = {str(r): {"line": a.get("user_line") or (f"cell line {a['cell_line']}"
                                                      if a.get("cell_line") else ""),
                      "collective": plain(a.get("collective"))}
             for r, a in res.where.items() if a}
    return {"available": True, "summary": getattr(err, "summary", str(err or "")),
            "culprits": d.culprits, "waiting": d.waiting, "died": plain(d.died),
            "timed_out": d.timed_out, "mismatch": d.mismatch, "reformed": bool(
                getattr(err, "reformed", False)),
            "verdict": diagnose.where_verdict(res), "where": where,
            "ranks": {str(r): _rank_failure(o) for r, o in res.outcomes.items()
                      if o.status != Status.OK},
            "report": getattr(err, "report", "")}


def log_records(c, last: int = 20, ranks: bool = False) -> dict:
    """``%dp log``: what dpnb caught here (this server), and each rank's log if asked."""
    out = {"server": dlog.recent(last)}
    if ranks:
        res = c.call(ep.LOG_RECORDS, last, raise_errors=False)
        out["ranks"] = {str(r): (res.outcomes[r].value if res.outcomes[r].status == Status.OK
                                 else [f"(no answer: {res.outcomes[r].status})"])
                        for r in res.ranks}
    return out


def memory(c) -> dict:
    """``%dp memory --live``: each rank's measured model-state bytes beside the exact
    prediction for its strategy (asks every rank for a snapshot, no collective)."""
    # lazy: matplotlib and ipywidgets load with the first view, not with the server
    from ..widgets import memory as mem

    try:
        lm = mem.fetch(c)
    except UserError as e:  # the view's one line: what is missing
        return _none(str(e))
    return {"available": True, "agrees": lm.agrees, **plain(lm)}


def profile_summary(c) -> dict:
    """The last profiled cell (``run_code`` with ``profile``): compute, exposed
    communication and idle per rank, the straggler, the sentences ``%dp profile`` writes."""
    # lazy: matplotlib and ipywidgets load with the first view, not with the server
    from ..widgets import profile as prof

    try:
        d = prof.data(cluster=c)
    except UserError as e:  # the view's one line: what is missing
        return _none(str(e) + " (in this server: run_code with profile=true)")
    rep = d.profiled.report
    st = rep.straggler
    return {"available": True, "ranks": plain(list(rep.stats)),
            "straggler": None if st is None else plain(st), "summary": prof.summary(d)}


def batch_math(c) -> dict:
    """``%dp batch --live``: global batch = micro-batch x DP x grad-accum from the
    cluster's size and the last train call, and the scaled learning rates."""
    # lazy: matplotlib and ipywidgets load with the first view, not with the server
    from ..widgets import batch

    live = batch.live_settings(c)
    d = batch.data(**{k: int(v) for k, v in live.items()
                      if k in ("micro_batch", "dp", "grad_accum", "seq_len")}, live=live)
    return {"live": plain(live), "global_samples": d.global_samples,
            "global_tokens": d.global_tokens, "lr": plain(d.lr), "text": batch.text(d)}


def train_progress(c) -> dict:
    """The training session: the wrap, every train call, the last one's summary and
    each rank's last progress, and rank 0's live summary (no collective)."""
    st = c.training
    out = {"steps_done": st.steps_done, **plain(st.to_record()),
           "progress": plain({str(r): p for r, p in (st.last_train.progress.items()
                                                     if st.last_train else [])})}
    res = c.call(ep.LIVE_SUMMARY, ranks=[0], raise_errors=False)
    o = res.outcomes[0]
    out["rank0_live"] = plain(o.value) if o.status == Status.OK else f"(no answer: {o.status})"
    return out


def setup(c) -> dict:
    """``%dp setup``: what ``restart --resume`` would replay now, in order."""
    if not c.setup_log.wrapped:
        return {"replay": [], **_none("nothing to replay yet: a model must be wrapped first")}
    return {"available": True, "replay": describe_resume(c)}


# ------------------------------------------------------------------ actions
def interrupt(c, ranks: str | None = None) -> dict:
    """SIGINT to the selected ranks' engines (``%dp interrupt``)."""
    sel = parse_ranks(ranks, c.world_size)
    c.interrupt(ranks)
    return {"interrupted": sel}


def restart(c, hard: bool = False, resume: str | None = None) -> dict:
    """``%dp restart [--hard] [--resume [DIR]]`` (``resume=""``: the latest autosave)."""
    return {"message": c.restart(hard=hard, resume=resume), "generation": c.generation,
            "pids": [r.pid for r in c.ranks]}


def reform(c) -> dict:
    """``%dp reform``: a new process group on a fresh port, state kept."""
    return {"message": c.reform()["message"], "generation": c.generation}


def save(c, path: str) -> dict:
    """``%dp save PATH``: model, optimizer and step with torch.distributed.checkpoint."""
    return plain(c.save(path))


# --------------------------------------------------------------------- code
def run_code(c, code: str, ranks: str | None, timeout_s: float, profile: bool) -> dict:
    """Run ``code`` as a ``%%dp`` cell on the selected ranks, stopped after
    ``timeout_s``; each rank's output, value and error (a failure is kept for
    ``last_error`` and ``where``)."""
    kw = dict(ranks=ranks, timeout=timeout_s, stream=False, display=False, raise_errors=False)
    res = c.profile(code, **kw) if profile else c.run(code, **kw)
    out = {"ok": res.ok, "elapsed_s": round(res.elapsed_s, 3), "ranks": {}}
    for r in res.ranks:
        o = res.outcomes[r]
        value = (o.execute_result or {}).get("data", {}).get("text/plain")
        out["ranks"][str(r)] = {"status": str(o.status), "stdout": o.stdout, "stderr": o.stderr,
                                "value": value}
    if res.error is not None:
        out["error"] = {"summary": getattr(res.error, "summary", str(res.error)),
                        "report": getattr(res.error, "report", "")}
    return out
