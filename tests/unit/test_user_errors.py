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
