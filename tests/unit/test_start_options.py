"""``dpnb.start(n, **kw)`` and ``%dp start`` build one ``StartOptions`` value, checked
once by ``Engines.start_with``; an option that does not exist is refused in one line
before anything starts."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

import dpnb
from dpnb.cluster.types import StartOptions
from dpnb.errors import DpnbError
from dpnb.session import Cluster


class Started(Exception):
    """Raised by the stand-in start: nothing is really started."""


def test_dpnb_start_and_the_magic_build_the_same_options(monkeypatch):
    got = []

    def fake(cls, o, warm=None):
        got.append(o)
        raise Started

    monkeypatch.setattr(Cluster, "start_with", classmethod(fake))
    monkeypatch.setenv("DPNB_PREWARM", "0")  # no zygote started ahead: nothing starts here
    with pytest.raises(Started):
        dpnb.start(3, backend="gloo", seed=1, launcher_args=["x=1"], timeout=30.0)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dpnb")
    with pytest.raises(Started):
        shell.run_line_magic("dp", "start -n 3 --backend gloo --seed 1 --launcher-arg x=1 "
                                   "--timeout 30 --no-zygote")
    assert got[0] == StartOptions(n=3, backend="gloo", seed=1, launcher_args=("x=1",),
                                  timeout=30.0)
    assert got[1] == StartOptions(n=3, backend="gloo", seed=1, launcher_args=("x=1",),
                                  timeout=30.0, zygote=False)


def test_an_option_that_does_not_exist_is_refused_in_one_line():
    with pytest.raises(DpnbError, match=r"start takes no bakend: its options are .*backend"):
        dpnb.start(2, bakend="gloo")
