"""The session's progress feed: who hears about a running ``train``, through one small API.

Rank 0 publishes :class:`~dpnb.core.events.ProgressEvent` s through
ipyparallel's data channel while the notebook's main thread waits for the
call; :func:`dpnb.session.verbs.train` decodes each one once and hands it to
:meth:`ProgressFeed.publish`, which calls every subscriber in turn on that
thread: the live progress view (for the call's length), the dashboard, and
JupyterLab's sidebar (:mod:`dpnb.cluster.publish`); next, an agent or a lab
panel subscribes the same way (``unsubscribe = cluster.subscribe(fn)``).  A
subscriber that raises is logged and kept: one broken view must not end a
training call or starve the others.  Nothing here communicates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..core.events import ProgressEvent

log = logging.getLogger(__name__)

Subscriber = Callable[[ProgressEvent], None]


class ProgressFeed:
    """Subscribers of the session's progress events, called in the order they subscribed."""

    def __init__(self) -> None:
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()  # a dashboard's thread may subscribe while train publishes

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn(event)`` for every progress event from now on; returns ``unsubscribe``."""
        with self._lock:
            self._subs.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subs:
                    self._subs.remove(fn)
        return unsubscribe

    def publish(self, ev: ProgressEvent) -> None:
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            try:
                fn(ev)
            except Exception as e:  # one view's bug must not end the training call
                log.warning("progress subscriber %r failed: %s: %s", fn, type(e).__name__, e,
                            exc_info=True)

    def __len__(self) -> int:
        return len(self._subs)
