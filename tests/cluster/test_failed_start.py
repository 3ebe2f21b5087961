"""A start that fails at any point stops everything it started.

Each case makes one step of the start fail on purpose -- after the engines
registered, after the ranks were placed, after rank 0 opened the store, at the
last step -- and finds no process left below this one that the start spawned
(controller, its schedulers, engines, the zygote's forks, the reaper) and no
profile folder.  One case also makes ipyparallel's own stop of the half-started
controller do nothing, as it sometimes fails to (a two-host start whose remote
Python lacked ipyparallel left the controller and its seven workers running in
1 of 4 runs): the start's own record of what it spawned, by PID and start time,
is then all that stops them.
"""

from __future__ import annotations

import gc
import glob
import os
import tempfile
import threading

import pytest

import dpnb
import dpnb.cluster as cluster_mod
from dpnb.cluster import Engines, engines, group, launch, processes, publish
from dpnb.lab import clusters as lab_clusters
from helpers import nbutil as nbu


class Injected(RuntimeError):
    """The failure a case plants in one step of the start."""


def _fail(*_a, **_k):
    raise Injected("a step of the start failed on purpose")


#: step of the start -> (object, attribute) made to raise there
STEPS = {
    "engines registered, not yet probed": (engines, "probe"),
    "engines probed, ranks not placed": (engines, "assign_ranks"),
    "ranks initialised, group not formed": (group.Group, "form"),
    "group formed, reaper not adopted": (processes.Processes, "adopt_reaper"),
}


def _profiles() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "dpnb-profile-*")))


def _live_clusters() -> list:
    """Every Engines object of this process that still says it runs."""
    return [o for o in gc.get_objects() if isinstance(o, Engines) and o.running]


def _start_fails_and_leaves_nothing(monkeypatch) -> None:
    before, folders = nbu.descendants(os.getpid()), _profiles()
    files, hooks = set(os.listdir(publish.publish_dir())), []
    # the runtime's exit hooks, recorded (ipyparallel's own are not the runtime's to undo)
    monkeypatch.setattr(cluster_mod.atexit, "register", lambda fn, *a: hooks.append(fn) or fn)
    listed = {c["id"] for c in lab_clusters.clusters()}
    with pytest.raises(Injected):
        dpnb.start(1)
    spawned = {p: t for p, t in nbu.descendants(os.getpid()).items() if before.get(p) != t}
    # a clean stop takes about a quarter second; 10 s separates "stopped" from "left running"
    assert nbu.alive(spawned, wait_s=10) == {}
    assert _profiles() - folders == set()
    # nothing of a cluster that never was: no record for JupyterLab's sidebar (its API
    # lists nothing new), no publishing thread, no exit hook, no Engines that says it runs
    assert set(os.listdir(publish.publish_dir())) - files == set()
    assert {c["id"] for c in lab_clusters.clusters()} - listed == set()
    assert [t.name for t in threading.enumerate() if t.name.startswith("dpnb-publish")] == []
    assert [f for f in hooks if f.__module__.startswith("dpnb")] == []
    assert _live_clusters() == []


@pytest.mark.parametrize("step", list(STEPS))
def test_a_start_failing_at_each_step_leaves_no_process(step, monkeypatch):
    obj, name = STEPS[step]
    monkeypatch.setattr(obj, name, _fail)
    _start_fails_and_leaves_nothing(monkeypatch)


def test_a_failed_start_whose_ipyparallel_stop_does_nothing_leaves_no_process(monkeypatch):
    monkeypatch.setattr(engines, "probe", _fail)
    monkeypatch.setattr(launch, "stop_ipp", lambda icluster: None)  # the controller is not stopped
    _start_fails_and_leaves_nothing(monkeypatch)
