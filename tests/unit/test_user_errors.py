"""Bad input is one line wherever it is raised: the names the notebook treats
so (``USER_ENAMES``, read from a rank's error) are exactly dpnb's subclasses
of :class:`dpnb.core.errors.UserError` -- a new error class cannot be
forgotten there, and no name is listed that no class defines."""

from __future__ import annotations

import importlib
import pkgutil

import dpnb
from dpnb.cluster.types import USER_ENAMES
from dpnb.core.errors import UserError


def _every(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _every(sub)


def test_user_enames_are_the_user_error_classes():
    for m in pkgutil.walk_packages(dpnb.__path__, "dpnb."):
        importlib.import_module(m.name)
    names = {c.__name__ for c in _every(UserError) if c.__module__.startswith("dpnb.")}
    assert {"TrainError", "ViewError", "AdoptError", "ConfigError", "StartError"} <= names
    assert names | {"UserError"} == USER_ENAMES


def test_each_error_name_is_one_class():
    """One name, one meaning: a view's error is the same class on a rank and in
    the notebook (``except ViewError`` catches both), and no two UserError
    subclasses share a name."""
    for m in pkgutil.walk_packages(dpnb.__path__, "dpnb."):
        importlib.import_module(m.name)
    by_name: dict[str, set] = {}
    for c in _every(UserError):
        if c.__module__.startswith("dpnb."):
            by_name.setdefault(c.__name__, set()).add(f"{c.__module__}.{c.__qualname__}")
    assert {n: w for n, w in by_name.items() if len(w) > 1} == {}
    from dpnb.engine.train.train_state import ViewError as on_ranks
    from dpnb.widgets import ViewError as in_notebook

    assert on_ranks is in_notebook and issubclass(on_ranks, ValueError) \
        and issubclass(on_ranks, RuntimeError)
