"""Views read the session through one typed contract, never the cluster's insides.

:class:`dpnb.core.viewsource.ViewSource` is everything a view may ask: engine
calls by name, status rows, whether a call is in flight, the progress the
ranks published, the last train (a typed ``LastRun``), the residency store.
The session's ``dpnb.Cluster`` implements it; a view that reached for the
ipyparallel client or the session's state (``cluster.client``,
``getattr(cluster, "training", None)``, ``cluster.training.residency = ...``)
would break the day either changes, and a JupyterLab panel or an agent could
not hand a view its own source.  Read from the source (ast), plus the
session's side of the contract run on plain objects.
"""

from __future__ import annotations

import ast
import pathlib
import threading
import typing

from dpnb.cluster import Engines
from dpnb.core.viewsource import LastRun, ViewSource
from dpnb.session import Cluster
from dpnb.core.events import TrainSummary
from dpnb.core.trainargs import TrainArgs
from dpnb.session.training_state import LastTrain, TrainingState

PKG = pathlib.Path(__file__).resolve().parents[2] / "dpnb"
WIDGETS = PKG / "widgets"
#: what a view calls the source it was given
HOLDERS = {"cluster", "self.cluster"}
#: the members of the contract
MEMBERS = {n for n in dir(ViewSource) if not n.startswith("_")} | set(typing.get_type_hints(ViewSource))


def _views():
    for p in sorted(WIDGETS.rglob("*.py")):
        yield p.relative_to(PKG.parent), ast.parse(p.read_text())


def test_no_view_reaches_into_the_cluster():
    reach = []
    for rel, tree in _views():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in ("client", "training"):
                reach.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "hasattr") \
                    and n.args and ast.unparse(n.args[0]) in HOLDERS:
                reach.append(f"{rel}:{n.lineno} {ast.unparse(n)} (duck-typing the source)")
    assert not reach, "views read the session through dpnb.core.viewsource.ViewSource: " + "; ".join(reach)


def test_views_use_only_the_contract():
    """Every ``cluster.X`` a view reads is a member of ``ViewSource``."""
    assert {"call", "in_flight", "published_progress", "last_run", "keep_residency"} <= MEMBERS
    outside = []
    for rel, tree in _views():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and ast.unparse(n.value) in HOLDERS \
                    and n.attr not in MEMBERS:
                outside.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not outside, f"add to ViewSource (the session supplies it) or drop: {outside}"


def test_the_session_implements_the_contract():
    """Methods on the class; data members set by ``Engines`` / ``Cluster``'s ``__init__``."""
    inits = set()
    for path in (PKG / "cluster" / "__init__.py", PKG / "session" / "__init__.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                    and ast.unparse(n.value) == "self":
                inits.add(n.attr)
    missing = sorted(m for m in MEMBERS if not hasattr(Cluster, m) and m not in inits)
    assert not missing, missing
    # the session's own members of the contract shadow nothing of the runtime
    # (``Engines.busy`` is the set of busy ranks, which the runtime reads itself)
    own = {m for m in MEMBERS if m in vars(Cluster)}
    assert own >= {"in_flight", "published_progress", "last_run", "keep_residency"}, own
    shadowed = sorted(m for m in own if hasattr(Engines, m) or m in inits - {"last_profile"})
    assert not shadowed, shadowed


def _session(last_train=None) -> Cluster:
    c = Cluster.__new__(Cluster)  # the session's view side only: no engines
    c.training = TrainingState(last_train=last_train)
    return c


def test_the_session_keeps_residency_per_strategy_for_one_model_size():
    c = _session()
    assert c.keep_residency(100, "ddp", ("d",)) == {"ddp": ("d",)}
    assert c.keep_residency(100, "zero2", ("z",)) == {"ddp": ("d",), "zero2": ("z",)}
    assert c.keep_residency(100, "ddp", ("d2",)) == {"ddp": ("d2",), "zero2": ("z",)}
    assert c.keep_residency(200, "zero3", ("x",)) == {"zero3": ("x",)}  # another model: the rest forgotten


def test_the_session_hands_views_the_last_run_typed():
    assert _session().last_run() is None
    t = LastTrain(TrainArgs(micro_batch=8, grad_accum=2, steps=3), TrainSummary(last_step=2), {0: {"step": 2}})
    run = _session(last_train=t).last_run()
    assert isinstance(run, LastRun)
    assert run.settings["micro_batch"] == 8 and run.settings["grad_accum"] == 2
    assert run.progress == {0: {"step": 2}}


class _Source:
    """A view source that is no cluster at all: what a Lab panel or a test may pass."""

    world_size, backend, ranks, running, last_profile = 2, "gloo", (), True, None

    def __init__(self, final):
        self.final = final

    def call(self, dotted, *args, ranks=None, raise_errors=True, **kw):
        raise AssertionError("the poller sends nothing while training runs")

    def status(self):
        return []

    def in_flight(self):
        return True

    def subscribe(self, fn):
        return lambda: None

    def published_progress(self, seen):
        return {1: {"rank": 1, "step": 1, "loss": 0.5, "history": [[1, 0.5]]}}

    def last_run(self):
        return LastRun({"micro_batch": 4}, self.final)

    def keep_residency(self, model_bytes, strategy, found):
        return {strategy: found}


def test_the_dashboard_follows_a_run_through_the_contract_alone():
    from dpnb.widgets import dashboard

    class Box:
        refreshed = 0

        def refresh(self):
            Box.refreshed += 1

    state = {"status": [], "summaries": [], "progress": {}, "history": {}, "running": False}
    src = _Source(final={0: {"rank": 0, "step": 3, "loss": 0.25, "done": True}})
    poller = dashboard._Poller(Box(), src, state, threading.RLock(), 1.0)
    poller.tick()
    assert state["running"] is True and Box.refreshed == 1
    assert state["progress"][0]["step"] == 3  # the run's end, from the session's LastRun
    assert state["progress"][1]["step"] == 1 and 1 in state["history"]  # what rank 1 published
