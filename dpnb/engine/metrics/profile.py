"""``%%dp --profile``: torch.profiler on this rank around a cell, a train or a script.

The notebook calls :func:`begin` on every profiled rank (for a cell, the
cell's own request asks for it: :mod:`dpnb.engine.metrics.profilemark`), runs
the cell as usual, then calls :func:`end`.  Nothing here talks to the other ranks: each
rank records its own threads (and its GPU), writes its Chrome trace into
its private folder, and sends back a bounded
:class:`dpnb.core.profile.RankTrace` plus the trace itself when it is small
enough; the notebook puts the ranks on one clock
(:func:`dpnb.core.profile.analyze`).  The clock: :func:`begin` reads the
wall clock inside a marker span, so the notebook can map each trace's clock
onto the wall clock.

Profiling off costs nothing: no hook stays installed between profiles.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import socket
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dpnb.core.cellflags import PROFILE_CARRY, carried_value, carry_text
from dpnb.core.traces import CLOCK_MARKER, END_MARKER, RankTrace, extract, wall_offset
from dpnb.engine.proc.private import private_dir
from dpnb.engine.state import get_state

log = logging.getLogger(__name__)

#: a rank's Chrome trace travels to the notebook only below this size
MAX_TRACE_BYTES = 32 << 20


class _Running:
    """The profiler between begin and end, and the wall clock read beside its marker."""

    def __init__(self, prof, wall_us: float, path: str):
        self.prof, self.wall_us, self.path = prof, wall_us, path


def begin(ns: dict, tag: str, record_shapes: bool = True) -> str:
    """Start recording this rank (CPU threads, and its GPU under NCCL); returns the folder.

    ``tag`` names the profile (the same on every rank).  A profile already
    running on this rank (a cell that failed before ``end``) is dropped first.
    """
    st = get_state(ns)
    if st.profiler is not None:
        _drop(st, "a new profile started before the last one ended")
    st.carry.pop(PROFILE_CARRY, None)  # a failed cell's end nobody collected: stale now
    st.profile_blob = None
    acts = [ProfilerActivity.CPU]
    if st.backend == "nccl" and torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    folder = os.path.join(private_dir(), "profiles")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    prof = profile(activities=acts, record_shapes=record_shapes)
    prof.start()
    with record_function(CLOCK_MARKER):
        wall_us = time.time_ns() / 1000.0
    st.profiler = _Running(prof, wall_us, os.path.join(folder, f"{tag}.rank{st.rank}.json"))
    return folder


class _NotStarted:
    """A profile asked for in a cell's request whose profiler did not start."""

    def __init__(self, why: str):
        self.why = why


def failed_to_start(ns: dict, why: str) -> None:
    """Keep why this rank's profiler did not start, for :func:`end` to say."""
    get_state(ns).profiler = _NotStarted(why)


def _drop(st, why: str) -> None:
    run, st.profiler = st.profiler, None
    if not isinstance(run, _Running):
        return
    try:
        run.prof.stop()
    except Exception as e:  # already stopped, or torch refused: nothing is left running
        log.info("stopping a dropped profile (%s): %s: %s", why, type(e).__name__, e)


def end(ns: dict) -> tuple[RankTrace, bytes | None]:
    """Stop, write the trace (0600, in this user's private folder), and return the
    bounded record and the gzipped trace; a trace over :data:`MAX_TRACE_BYTES`
    stays where it is (``None`` instead of the trace)."""
    st = get_state(ns)
    if PROFILE_CARRY in st.carry:  # ended with its cell, the reply not sent home (the cell failed)
        rec, blob, kept = carried_value(st.carry.pop(PROFILE_CARRY))
        return rec, (take(ns) if kept else blob)
    host = socket.gethostname()
    run = st.profiler
    if not isinstance(run, _Running):
        st.profiler = None
        why = (f"torch.profiler did not start ({run.why})" if isinstance(run, _NotStarted)
               else "no profile was running on this rank (restarted since?)")
        return RankTrace(st.rank, host, "cpu", 0.0, 0.0, 0.0, (), (), error=why), None
    st.profiler = None
    with record_function(END_MARKER):
        pass
    run.prof.stop()
    path = run.path
    run.prof.export_chrome_trace(path)
    os.chmod(path, 0o600)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read()
    events = json.loads(raw).get("traceEvents", [])
    stays = size > MAX_TRACE_BYTES  # too big to travel: this file is the only copy
    rec = extract(events, rank=st.rank, host=host, wall_offset_us=wall_offset(events, run.wall_us),
                  trace_file=path if stays else "", trace_bytes=size)
    if stays:
        return rec, None
    blob = gzip.compress(raw, 3)
    os.remove(path)  # the notebook writes the copy people use
    return rec, blob


#: a profiled cell's gzipped trace rides in the cell's reply (base64 text) up to
#: this size; a bigger one waits on the rank for :func:`take` (its own call,
#: with ipyparallel's binary buffers)
INLINE_TRACE_BYTES = 256 << 10


def end_into_reply(ns: dict) -> None:
    """:func:`end`, its result left for the cell's own reply (``carry``): the
    profiled cell's rank records come home with the cell, with no call after it."""
    st = get_state(ns)
    rec, blob = end(ns)
    kept = blob is not None and len(blob) > INLINE_TRACE_BYTES
    if kept:
        st.profile_blob, blob = blob, None
    st.carry[PROFILE_CARRY] = carry_text((rec, blob, kept))


def take(ns: dict) -> bytes | None:
    """The gzipped trace :func:`end_into_reply` kept here (once)."""
    st = get_state(ns)
    blob, st.profile_blob = st.profile_blob, None
    return blob


def drop(ns: dict) -> bool:
    """Stop a running profile without keeping it (a start that failed on another rank);
    True if one ran."""
    st = get_state(ns)
    ran = isinstance(st.profiler, _Running)
    _drop(st, "dropped by the notebook")
    return ran
