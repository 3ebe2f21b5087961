"""The single error type of :mod:`dpnb.core`.

Every invalid configuration is reported as :class:`ConfigError`.  It subclasses
:class:`ValueError` so callers that already catch ``ValueError`` keep working.
The house rule for its messages: print every factor that went into the
failing check (so the user can see the arithmetic, not just the verdict) and
say what to change.
"""


class UserError(Exception):
    """Base of every error that means "bad input": a message of one line that
    says what to do, shown without a traceback wherever it was raised (the
    notebook, or a rank: :data:`dpnb.cluster.types.USER_ENAMES` names every
    subclass, held equal by ``tests/unit/test_user_errors.py``)."""


class ViewError(UserError, ValueError, RuntimeError):
    """A view cannot be drawn from what it has: nothing trained or wrapped yet on a
    rank, or records a figure cannot use.  The message says what to do.  One class
    for the engine's views and the notebook's (a ValueError and a RuntimeError, as
    each side's callers caught it)."""


class ConfigError(UserError, ValueError):
    """An invalid or unsatisfiable training configuration.

    The message shows the arithmetic that failed (every factor) and at least
    one concrete way to fix it.
    """
