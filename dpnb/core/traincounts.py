"""The rule for ``train``'s counts, in one place: steps, epochs, micro-batch, grad-accum.

Two sides read the same arguments: the notebook checks them before it sends
anything (:func:`dpnb.session.verbs.train`, so a typo costs no round trip),
and every rank checks them again before its step loop
(:mod:`dpnb.engine.train.trainplan`, since ``cluster.call(ep.TRAIN, ...)`` and an
exported job reach the engine without the session).  Both ask
:func:`count_problem`, so both refuse the same values with the same line --
each raising its own layer's :class:`~dpnb.core.errors.UserError`.
Pure: no torch.
"""

from __future__ import annotations

#: train's counts, each a whole number >= 1 when given
COUNTS = ("steps", "epochs", "micro_batch", "grad_accum")


def count_problem(required: tuple[str, ...] = (), **counts: object) -> str | None:
    """The one-line problem with the first bad count in ``counts``, or None.

    A count is a whole number (``True`` is not one) of at least 1; ``None``
    means "not given", which only the names in ``required`` refuse.
    """
    for name, v in counts.items():
        if name not in COUNTS:
            raise TypeError(f"{name!r} is not one of train's counts {COUNTS}")
        if v is None and name not in required:
            continue
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"--{name.replace('_', '-')} must be a whole number >= 1 (got {v!r})"
    return None
