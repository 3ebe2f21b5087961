"""``%%dp --profile`` told in the cell's own request: the profiler starts with the cell.

A profiled cell travels with a ``# dpnb: --profile TAG`` line after it
(:mod:`dpnb.core.cellflags`); this rank's ``pre_run_cell`` hook (IPython hands
it the raw cell) sees it and starts ``torch.profiler``
(:func:`dpnb.engine.metrics.profile.begin`) just before the cell runs.  No
request goes to the ranks before the cell, and none after it: the
``post_run_cell`` hook stops the profiler as the cell ends and leaves the
rank's record (and its trace, when small) for the cell's own reply
(:func:`~dpnb.engine.metrics.profile.end_into_reply`,
:mod:`dpnb.engine.cell.outcount`).  A profiled cell costs what torch's
profiler by hand costs plus reading the trace's record on each rank.

The session arms the hook (:func:`arm`, an entry point) on an engine's first
profiled cell -- profiling is the session's, not the runtime's -- and
remembers the engines it armed.  A profiler that does not start is not a
refusal: the cell runs, and the end's record says why that rank has no
profile.  Torch-free at import; the profiler module loads on the first
profiled cell.
"""

from __future__ import annotations

import logging

from dpnb.core.cellflags import profile_tag

log = logging.getLogger(__name__)


def arm(ns: dict) -> bool:
    """Register the hook on this engine's shell (once); True when it is there."""
    from IPython import get_ipython  # lazy: an engine's shell, asked when armed

    shell = get_ipython()
    if shell is None:
        return False
    for event, hook in (("pre_run_cell", pre_run_cell), ("post_run_cell", post_run_cell)):
        if hook not in shell.events.callbacks.get(event, []):
            shell.events.register(event, hook)
    return True


def pre_run_cell(info=None, *_rest) -> None:
    tag = profile_tag(getattr(info, "raw_cell", None))
    if tag is None:
        return
    # lazy: torch.profiler, on the first profiled cell only
    from dpnb.engine.metrics import profile
    from dpnb.engine.proc.shell import user_ns

    ns = user_ns()
    try:
        profile.begin(ns, tag)
    except Exception as e:  # the cell runs unprofiled; the end's record says why
        log.warning("torch.profiler did not start for profile %s: %s: %s", tag,
                    type(e).__name__, e, exc_info=True)
        profile.failed_to_start(ns, f"{type(e).__name__}: {e}")


def post_run_cell(result=None, *_rest) -> None:
    """The profiled cell has run (raised or not): stop this rank's profiler and
    leave its record for the cell's reply (:func:`dpnb.engine.metrics.profile.end_into_reply`)."""
    tag = profile_tag(getattr(getattr(result, "info", None), "raw_cell", None))
    if tag is None:
        return
    # lazy: torch.profiler, on profiled cells only
    from dpnb.engine.metrics import profile
    from dpnb.engine.proc.shell import user_ns

    try:
        profile.end_into_reply(user_ns())
    except Exception as e:  # the notebook's end call asks again, and says what it got
        log.warning("profile %s not ended with its cell: %s: %s", tag, type(e).__name__, e,
                    exc_info=True)
