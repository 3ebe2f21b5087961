"""Errors dpnb raises on the notebook side.

Every error a user can cause is a :class:`DpnbError` whose message is one
line that says what to do.  The magics turn these into IPython ``UsageError``
(shown without a traceback); the Python API raises them as they are.
"""

from __future__ import annotations

from .core.errors import UserError


class DpnbError(UserError):
    """A problem the user can fix; the message says how."""


class NotRunningError(DpnbError):
    """No cluster is running (or it was stopped)."""


class RankSpecError(DpnbError, ValueError):
    """A ``--ranks`` selection that does not parse or is out of range."""


class StartError(DpnbError):
    """The engines or the process group could not be brought up."""


class RemoteCellError(DpnbError):
    """A cell raised on one or more ranks.

    ``report`` is the full human-readable report (failing ranks, the
    traceback once per distinct failure, ranks that were waiting on them);
    ``str(err)`` is its one-line summary.
    """

    def __init__(self, summary: str, report: str, failures: dict, waiting: list[int],
                 died: dict | None = None, timed_out: list[int] | None = None,
                 reformed: bool = False):
        super().__init__(summary)
        self.summary = summary
        self.report = report
        self.failures = failures  # rank -> (ename, evalue, traceback text)
        self.waiting = waiting  # ranks that only failed because a peer did
        self.died = died or {}  # rank -> description of how it died
        self.timed_out = timed_out or []  # ranks still running at the cell timeout
        self.reformed = reformed  # the process group was re-formed afterwards

    def _render_traceback_(self):  # IPython shows this instead of a Python traceback
        return self.report.splitlines()
