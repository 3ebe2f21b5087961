"""Stopping training at a step boundary (Ctrl-C, the Stop button, a stop file) and publishing progress.

A KeyboardInterrupt raised inside a collective would leave the other ranks
waiting in it, so SIGINT only sets a flag here; the flag travels with each
step's stats gather, and every rank stops after the same step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)


class StopRequest:
    """Turns Ctrl-C (SIGINT) and the Stop button into a flag that the loop
    reads at step boundaries, so no KeyboardInterrupt ever lands inside a
    collective (which would leave the other ranks waiting in it)."""

    def __init__(self, es):
        self.es = es
        self.sigint = False
        self._prev = None
        self._installed = False

    def __enter__(self):
        self.es.stop_requested = False
        path = self.es.stop_file
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def _handler(self, signum, frame):
        self.sigint = True

    def __exit__(self, *exc):
        if self._installed:
            prev = self._prev if self._prev is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, prev)
        return False

    def reason(self) -> str | None:
        if self.sigint:
            return "interrupt"
        if self.es.stop_requested:
            return "stop_requested"
        path = self.es.stop_file
        if path and os.path.exists(path):
            return "stop_file"
        return None


def _make_publisher(publish):
    if publish is None or publish is False:
        return None
    if callable(publish):
        return publish
    try:
        # lazy: publishing needs an engine's kernel; elsewhere training goes on without it
        from ipyparallel.datapub import publish_data
    except ImportError as e:  # not inside an engine: train without live progress
        log.info("no datapub (%s): progress is not published", e)
        return None
    return publish_data
