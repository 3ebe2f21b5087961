"""Calling engine-side functions by name with the engine's namespace.

The notebook sends ``call("dpnb.engine.training.train", args, kwargs)``;
only the dotted name travels, never a pickled closure, so the function that
runs is whatever version of dpnb the engine has imported.
"""

from __future__ import annotations

import importlib

from .. import log as dpnb_log
from .setup import user_ns, wait_preload


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    if not module.startswith("dpnb."):
        raise ValueError(f"refusing to call {dotted!r}: only dpnb functions are called by name")
    return getattr(importlib.import_module(module), name)


def call(dotted: str, args: tuple = (), kwargs: dict | None = None):
    """Run ``dotted(ns, *args, **kwargs)`` with this engine's user namespace."""
    wait_preload()  # never import torch's heavy modules from two threads at once
    ns = user_ns()
    return resolve(dotted)(ns, *args, **(kwargs or {}))


def has_names(names: list[str]) -> list[str]:
    """The names among ``names`` missing from this engine's namespace."""
    ns = user_ns()
    return [n for n in names if n not in ns]


def has_names_ns(ns: dict, names: list[str]) -> list[str]:
    """:func:`has_names` in the ``call(dotted, ...)`` convention (``ns`` first)."""
    return [n for n in names if n not in ns]


def get_value(name: str) -> list[bytes]:
    """``name``'s value, serialized here (ipyparallel's canning) for the
    notebook to unpack itself: a value that pickles on the engine but cannot
    be rebuilt in the notebook (a hook-free DDP asks for a process group
    there) would otherwise fail inside the client's I/O thread, and the pull
    would wait forever."""
    # lazy: the notebook imports this module for its functions' names, and
    # `import dpnb.cluster` stays free of ipyparallel
    from ipyparallel.serialize import serialize_object

    ns = user_ns()
    if name not in ns:
        raise NameError(name)
    return [bytes(b) for b in serialize_object(ns[name])]


def set_values(values: dict) -> list[str]:
    user_ns().update(values)
    return sorted(values)


def log_records(ns: dict, last: int | None = None) -> list[str]:
    """The last records of this engine's ``dpnb`` log (see :mod:`dpnb.log`)."""

    return dpnb_log.recent(last)
