"""``%%dp --profile``: profile one cell on every rank and bring the traces home.

The sequence: every selected rank starts ``torch.profiler``
(:func:`dpnb.engine.metrics.profile.begin`, no collective); the code runs
exactly as unprofiled; every rank stops and sends back its bounded record
and, below a size cap, its Chrome trace (:func:`dpnb.engine.metrics.profile.end`).
For a cell, both ends ride in the cell's own request and replies (started
and ended by the rank's hooks, :mod:`dpnb.engine.metrics.profilemark`); a
train or a script takes a call before and one after.  The notebook puts the ranks on one
clock and splits their time (:func:`dpnb.core.profile.analyze`), writes
each rank's trace and one merged trace into a folder, and keeps the result
as ``cluster.last_profile`` for ``%dp profile`` and
:mod:`dpnb.widgets.profile`.

A cell that fails while profiled still ends every rank's profiler; the
partial profile is kept and shown, then the cell's error is raised.

What the user waits for is what torch's profiler by hand costs them --
start, stop, export on each rank -- plus the bounded records' trip home and
the analysis (under a millisecond): the headline (straggler, exposed
communication) is ready when the result returns.  The traces came home in
the same reply; unpacking them, writing each rank's and building and writing
the merged one (most of the rest: ~85 ms of 135 for two 0.5 MB traces) happens
on a thread of its own (:class:`TraceWrite`), which a script's exit waits
for; ``Profiled.wait()`` (``wait=True``) for code that reads the files at once.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
import time
import uuid

from ..core.errors import ConfigError
from . import hooks
from ..core.profile import Profiled, RankTrace, analyze, merged_trace
from ..core.profilesummary import failure_note
from dpnb.engine import entrypoints as ep
from ..cluster.types import RankOutcome, Status
from ..core.cellflags import PROFILE_CARRY, carried_value
from ..errors import DpnbError, RemoteCellError

log = logging.getLogger(__name__)

#: where profiles go unless ``out_dir`` says otherwise (relative to the notebook)
DEFAULT_DIR = "dpnb-profiles"
#: the most ``%dp train`` steps one profile takes: torch.profiler holds every
#: event of every profiled step in each rank's memory until the profile ends
MAX_PROFILED_STEPS = 20


def _gather(results: list, notes: list[str]) -> tuple[list[RankTrace], dict[int, bytes]]:
    """The ranks' records, and the gzipped traces that came home by rank."""
    ranks, blobs = [], {}
    for rec, blob in results:
        ranks.append(rec)
        if blob is None:
            if rec.trace_bytes:
                notes.append(f"rank {rec.rank}: its trace ({rec.trace_bytes >> 20} MiB) is over the "
                             f"cap and stayed on {rec.host} at {rec.trace_file}")
            continue
        blobs[rec.rank] = blob
    return ranks, blobs


def _write_file(path: str, data: bytes) -> None:
    """Whole or not at all: a reader of the folder never sees half a trace."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class TraceWrite:
    """Each rank's trace and the merged one, written on a thread of its own.

    Not a daemon: a script that exits right after its profile still gets its
    files.  ``error`` says what failed (also logged); the analysis stands.
    """

    def __init__(self, report, blobs: dict[int, bytes], folder: str):
        self.done = threading.Event()
        self.error = ""
        self.thread = threading.Thread(target=self._write, args=(report, blobs, folder),
                                       name="dpnb-profile-traces")
        self.thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _write(self, report, blobs: dict[int, bytes], folder: str) -> None:
        try:
            traces = {}
            for r, blob in sorted(blobs.items()):
                text = gzip.decompress(blob)
                _write_file(os.path.join(folder, f"rank{r}.json"), text)
                traces[r] = json.loads(text)
            merged = json.dumps(merged_trace(report, traces), separators=(",", ":"))
            _write_file(os.path.join(folder, "merged.json"), merged.encode())
        except Exception as e:  # the analysis is kept; the files are said missing
            self.error = f"{type(e).__name__}: {e}"
            log.warning("profile traces not written to %s: %s", folder, self.error, exc_info=True)
        finally:
            self.done.set()


def _carried(res) -> dict[int, tuple]:
    """The profile each rank's reply carried home with the cell, by rank:
    ``(record, trace or None, trace kept on the rank)``."""
    out = {}
    for r, o in res.outcomes.items():
        text = o.carry.get(PROFILE_CARRY)
        if text is None:
            continue
        try:
            out[r] = carried_value(text)
        except Exception as e:  # asked again with the end call
            log.warning("rank %s: its profile in the reply was unreadable: %s: %s",
                        r, type(e).__name__, e)
    return out


def _ended(cluster, cell, ranks) -> dict:
    """Every profiled rank's end, by rank (outcomes whose value is ``(record, trace)``).
    A profiled cell's (``cell``, its result): from its replies where they carried it, a
    trace kept on its rank (too big for a reply) taken with one call, the end call
    only for ranks whose reply did not carry one (a failed cell's).  A train's or a
    script's (``cell`` None): the end call on every rank."""
    if cell is None:
        return dict(cluster.call(ep.PROFILE_END, ranks=ranks, raise_errors=False).outcomes)
    carried = _carried(cell)
    ended = {}
    if missing := [r for r in cell.ranks if r not in carried]:
        ended = dict(cluster.call(ep.PROFILE_END, ranks=missing, raise_errors=False).outcomes)
    kept = [r for r, (_, _, k) in carried.items() if k]
    taken = cluster.call(ep.PROFILE_TAKE, ranks=kept, raise_errors=False).outcomes if kept else {}
    for r, (rec, blob, k) in carried.items():
        ended[r] = (taken[r] if k and not taken[r].ok else
                    RankOutcome(r, Status.OK, (rec, taken[r].value if k else blob)))
    return ended


def _arm(cluster) -> None:
    """Register the profiling hook on every live engine not armed yet (:mod:`.hooks`)."""
    live = [r.rank for r in cluster.ranks if r.rank not in cluster.dead]
    hooks.arm(cluster, ep.PROFILE_ARM, live, cluster.profile_armed, "profiling",
              'its profile will say "no profile was running on this rank"')


def profiled(cluster, run, *, ranks=None, what: str = "cell", out_dir: str | None = None,
             wait: bool = False, in_request: bool = False):
    """Run ``run()`` with every selected rank profiled; return ``(run's result, Profiled)``.

    ``run`` raises as it would unprofiled; the profile is kept before the
    error goes on.  ``out_dir``: the folder for the traces (default
    ``dpnb-profiles/<time>``).  The trace files are written after this
    returns; ``wait=True`` returns once they are (``Profiled.wait()`` later).
    ``in_request``: ``run(tag)`` sends a cell flagged ``--profile TAG``
    (:func:`dpnb.core.cellflags.profile_flag`) that starts each rank's profiler
    itself (:mod:`dpnb.engine.metrics.profilemark`); no begin call before it.
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
    if in_request:
        _arm(cluster)
    else:
        began = cluster.call(ep.PROFILE_BEGIN, tag, ranks=ranks, raise_errors=False)
        bad = {r: o for r, o in began.outcomes.items() if not o.ok}
        if bad:  # nothing may stay profiling where it did start
            cluster.call(ep.PROFILE_DROP, ranks=ranks, raise_errors=False)
            r, o = next(iter(bad.items()))
            raise DpnbError(f"torch.profiler did not start on rank {r} ({o.ename}: {o.evalue}); "
                            f"nothing was run")
    result, err = None, None
    try:
        result = run(tag) if in_request else run()
    except BaseException as e:  # Ctrl-C too: raised again below, once the profilers are stopped
        err = e
    cell = None
    if in_request:  # the cell's result, whose replies carry the ranks' ends
        cell = result if err is None else (cluster.last_failure
                                           if isinstance(err, RemoteCellError) else None)
    try:
        ended = _ended(cluster, cell, ranks)
    except Exception as e:  # the cluster itself went (a stop, a dead controller)
        log.warning("profiles not collected: %s: %s", type(e).__name__, e)
        if err is not None:
            raise err from e
        raise
    notes = [f"rank {r}: the profile did not come back ({o.ename}: {o.evalue})"
             for r, o in ended.items() if not o.ok]
    ranks_got, blobs = _gather([o.value for o in ended.values() if o.ok], notes)
    failure = ((str(err).splitlines() or [type(err).__name__])[0]) if err is not None else ""
    if failure:
        notes.append(failure_note(what, failure))
    try:
        report = analyze(ranks_got, cluster.world_size, notes=notes)
    except ConfigError as e:
        if err is not None:
            raise err
        raise DpnbError(str(e)) from None
    writing = TraceWrite(report, blobs, folder)
    prof = Profiled(report, folder, what, failure,
                    files=("merged.json", *(f"rank{r}.json" for r in sorted(blobs))),
                    writing=writing)
    cluster.last_profile = prof
    if wait:
        prof.wait()
    log.info("profiled %s on ranks %s into %s", what, [r.rank for r in ranks_got], folder)
    if err is not None:  # cluster.last_profile holds what ran before it
        raise err
    return result, prof
