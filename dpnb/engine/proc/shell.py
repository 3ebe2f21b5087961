"""This engine's IPython shell, and the namespace ``%%dp`` cells run in.

Every engine function the notebook calls by name reads the user's objects
from here; nothing is kept in a module global.
"""

from __future__ import annotations


def _shell():
    """This engine's IPython shell."""
    # lazy: boot imports this module before the kernel (and IPython) exists
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:  # pragma: no cover - engines always run an IPython kernel
        raise RuntimeError("dpnb engine functions must run inside an ipyparallel engine")
    return ip


def user_ns() -> dict:
    """The namespace ``%%dp`` cells run in on this engine (its IPython user_ns)."""
    return _shell().user_ns
