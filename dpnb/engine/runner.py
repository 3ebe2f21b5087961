"""Calling engine-side functions by name with the engine's namespace.

The notebook sends ``call("dpnb.engine.train.training.train", args, kwargs)``;
only the dotted name travels, never a pickled closure, so the function that
runs is whatever version of dpnb the engine has imported.
"""

from __future__ import annotations

import copy
import importlib

from dpnb import log as dpnb_log
from dpnb.engine.proc.preload import wait_preload
from dpnb.engine.proc.shell import user_ns


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


def to_host(value):
    """``value`` with every tensor on an accelerator replaced by a CPU copy,
    through dicts, lists, tuples (named ones too) and sets; anything else is
    sent as it is.  A pulled CUDA tensor unpickled in the notebook would
    open a CUDA context there on the engine's device number (another
    physical GPU under ``--gpus``), or fail on a notebook host without a
    GPU; the rank's own value stays where it is."""
    # lazy: the notebook imports this module for its functions' names
    import torch

    def host(v):
        if isinstance(v, torch.Tensor):
            if v.device.type in ("cpu", "meta"):
                return v
            out = v.detach().cpu()
            return out.requires_grad_() if v.requires_grad and out.is_floating_point() else out
        if isinstance(v, dict):
            out = copy.copy(v)  # keeps an OrderedDict's or a defaultdict's kind
            out.update((k, host(x)) for k, x in v.items())
            return out
        if isinstance(v, tuple) and hasattr(v, "_fields"):  # a named tuple
            return type(v)(*(host(x) for x in v))
        if isinstance(v, (list, tuple, set, frozenset)):
            return type(v)(host(x) for x in v)
        return v

    return host(value)


def get_value(name: str) -> list[bytes] | None:
    """``name``'s value, serialized here (ipyparallel's canning) for the
    notebook to unpack itself: a value that pickles on the engine but cannot
    be rebuilt in the notebook (a hook-free DDP asks for a process group
    there) would otherwise fail inside the client's I/O thread, and the pull
    would wait forever.  Tensors arrive on the CPU (:func:`to_host`).
    ``None`` when this rank has no ``name``: a pull is one round trip to the
    ranks, the notebook says which lack it (a value is never ``None`` here)."""
    # lazy: the notebook imports this module for its functions' names, and
    # `import dpnb.cluster` stays free of ipyparallel
    from ipyparallel.serialize import serialize_object

    ns = user_ns()
    if name not in ns:
        return None
    return [bytes(b) for b in serialize_object(to_host(ns[name]))]


def set_values(values: dict) -> list[str]:
    user_ns().update(values)
    return sorted(values)


def log_records(ns: dict, last: int | None = None) -> list[str]:
    """The last records of this engine's ``dpnb`` log (see :mod:`dpnb.log`)."""

    return dpnb_log.recent(last)
