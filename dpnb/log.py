"""dpnb's log: every exception dpnb catches and does not re-raise is written here.

All modules log to the ``dpnb`` logger (or a child of it).  Nothing is printed
by default; two ways to see it:

* ``DPNB_LOG=debug`` (or ``info``, ``warning``) in the environment before
  ``%load_ext dpnb`` / ``dpnb.start``: records go to stderr as they happen;
* ``%dp log`` (``dpnb.log.recent()``): the last records kept in memory by a
  :class:`RecentHandler` attached to the ``dpnb`` logger -- on the notebook
  side and on every engine.

The handler lives on the logger itself (found by type), so there is no
module-level state here.
"""

from __future__ import annotations

import collections
import logging
import os

LOGGER = "dpnb"
ENV_VAR = "DPNB_LOG"
KEEP = 500


class RecentHandler(logging.Handler):
    """Keeps the last ``keep`` formatted records in memory for ``%dp log``."""

    def __init__(self, keep: int = KEEP):
        super().__init__(logging.DEBUG)
        self.records: collections.deque[str] = collections.deque(maxlen=keep)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(self.format(record))
        except Exception:  # logging must never raise into dpnb's code paths
            self.handleError(record)


def install(level: str | None = None) -> logging.Logger:
    """Attach the in-memory handler (once) and, with ``DPNB_LOG`` set, a stderr handler."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, RecentHandler) for h in logger.handlers):
        logger.addHandler(RecentHandler())
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the user's root handlers stay quiet unless asked
    want = level or os.environ.get(ENV_VAR)
    if want and not any(getattr(h, "_dpnb_stderr", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setLevel(getattr(logging, want.upper(), logging.DEBUG))
        h.setFormatter(logging.Formatter("dpnb %(levelname)s %(name)s: %(message)s"))
        h._dpnb_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(h)
    return logger


def recent(last: int | None = None) -> list[str]:
    """The last ``last`` (default: all kept) records of the ``dpnb`` logger."""
    for h in logging.getLogger(LOGGER).handlers:
        if isinstance(h, RecentHandler):
            rows = list(h.records)
            return rows[-last:] if last else rows
    return []
