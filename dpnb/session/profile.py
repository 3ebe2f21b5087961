"""``%%dp --profile``: profile one cell on every rank and bring the traces home.

The sequence: every selected rank starts ``torch.profiler``
(:func:`dpnb.engine.metrics.profile.begin`, one call, no collective); the cell runs
exactly as an unprofiled one would; every rank stops and sends back its
bounded record and, below a size cap, its Chrome trace
(:func:`dpnb.engine.metrics.profile.end`).  The notebook puts the ranks on one
clock and splits their time (:func:`dpnb.core.profile.analyze`), writes
each rank's trace and one merged trace into a folder, and keeps the result
as ``cluster.last_profile`` for ``%dp profile`` and
:mod:`dpnb.widgets.profile`.

A cell that fails while profiled still ends every rank's profiler; the
partial profile is kept and shown, then the cell's error is raised.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
import uuid

from ..core.errors import ConfigError
from ..core.profile import Profiled, RankTrace, analyze, merged_trace
from ..core.profilesummary import failure_note
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError

log = logging.getLogger(__name__)

#: where profiles go unless ``out_dir`` says otherwise (relative to the notebook)
DEFAULT_DIR = "dpnb-profiles"
#: the most ``%dp train`` steps one profile takes: torch.profiler holds every
#: event of every profiled step in each rank's memory until the profile ends
MAX_PROFILED_STEPS = 20


def _gather(results: list, folder: str, notes: list[str]) -> tuple[list[RankTrace], dict]:
    ranks, traces = [], {}
    for rec, blob in results:
        ranks.append(rec)
        if blob is None:
            if rec.trace_bytes:
                notes.append(f"rank {rec.rank}: its trace ({rec.trace_bytes >> 20} MiB) is over the "
                             f"cap and stayed on {rec.host} at {rec.trace_file}")
            continue
        text = gzip.decompress(blob)
        path = os.path.join(folder, f"rank{rec.rank}.json")
        with open(path, "wb") as f:
            f.write(text)
        traces[rec.rank] = json.loads(text)
    return ranks, traces


def profiled(cluster, run, *, ranks=None, what: str = "cell", out_dir: str | None = None):
    """Run ``run()`` with every selected rank profiled; return ``(run's result, Profiled)``.

    ``run`` raises as it would unprofiled; the profile is kept before the
    error goes on.  ``out_dir``: the folder for the traces (default
    ``dpnb-profiles/<time>``).
    """
    cluster.require_running()
    cluster.last_profile = None
    tag = time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:6]}"  # unique per profile
    folder = os.path.abspath(os.path.expanduser(out_dir or os.path.join(DEFAULT_DIR, tag)))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise DpnbError(f"cannot write the profile to {folder}: {e.strerror}; give another "
                        f"folder with --profile-dir") from None
    began = cluster.call(ep.PROFILE_BEGIN, tag, ranks=ranks, raise_errors=False)
    bad = {r: o for r, o in began.outcomes.items() if not o.ok}
    if bad:  # nothing may stay profiling where it did start
        cluster.call(ep.PROFILE_DROP, ranks=ranks, raise_errors=False)
        r, o = next(iter(bad.items()))
        raise DpnbError(f"torch.profiler did not start on rank {r} ({o.ename}: {o.evalue}); "
                        f"nothing was run")
    result, err = None, None
    try:
        result = run()
    except BaseException as e:  # Ctrl-C too: raised again below, once the profilers are stopped
        err = e
    try:
        ended = cluster.call(ep.PROFILE_END, ranks=ranks, raise_errors=False)
    except Exception as e:  # the cluster itself went (a stop, a dead controller)
        log.warning("profiles not collected: %s: %s", type(e).__name__, e)
        if err is not None:
            raise err from e
        raise
    notes = [f"rank {r}: the profile did not come back ({o.ename}: {o.evalue})"
             for r, o in ended.outcomes.items() if not o.ok]
    ranks_got, traces = _gather([o.value for o in ended.outcomes.values() if o.ok], folder, notes)
    failure = ((str(err).splitlines() or [type(err).__name__])[0]) if err is not None else ""
    if failure:
        notes.append(failure_note(what, failure))
    try:
        report = analyze(ranks_got, cluster.world_size, notes=notes)
    except ConfigError as e:
        if err is not None:
            raise err
        raise DpnbError(str(e)) from None
    with open(os.path.join(folder, "merged.json"), "w") as f:
        json.dump(merged_trace(report, traces), f)
    prof = Profiled(report, folder, what, failure)
    cluster.last_profile = prof
    log.info("profiled %s on ranks %s into %s", what, [r.rank for r in ranks_got], folder)
    if err is not None:  # cluster.last_profile holds what ran before it
        raise err
    return result, prof
