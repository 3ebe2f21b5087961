"""The single error type of :mod:`dpnb.core`.

Every invalid configuration is reported as :class:`ConfigError`.  It subclasses
:class:`ValueError` so callers that already catch ``ValueError`` keep working.
The house rule for its messages: print every factor that went into the
failing check (so the user can see the arithmetic, not just the verdict) and
say what to change.
"""


class ConfigError(ValueError):
    """An invalid or unsatisfiable training configuration.

    The message shows the arithmetic that failed (every factor) and at least
    one concrete way to fix it.
    """
