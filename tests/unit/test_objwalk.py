"""The walk that finds what holds the old process group after a re-formation:
it reaches attributes, slots and containers, runs no user code, ends on cycles
and stops at its bounds, saying so (the real objects: tests/ecosystem/
test_libraries_hold_models.py)."""

from __future__ import annotations

import logging

from dpnb.core.objwalk import walk


class Group:
    """Stands for the old process group."""


OLD = Group()


def classify(obj):
    return ("group", False) if obj is OLD else (None, True)


class Tricky:
    @property
    def lazy(self):
        raise AssertionError("the walk ran a property")

    def __getattr__(self, name):
        raise AssertionError(f"the walk asked __getattr__ for {name}")


class Slotted:
    __slots__ = ("pg", "unset")


def test_every_place_holding_the_object_is_found_and_assigned_without_running_user_code():
    outer, slotted = Tricky(), Slotted()
    slotted.pg = OLD
    outer.inner = {"pg": OLD, "models": [1, OLD, (OLD,)], "slotted": slotted}
    outer.me = outer  # a cycle
    ns = {"trainer": outer, "pg": OLD, "_hidden": OLD}
    w = walk(ns, classify, names=["trainer", "pg"])
    assert [h.kind for h in w.hits] == ["group"] and not w.truncated
    paths = {s.path: s.how for s in w.hits[0].slots}
    assert paths == {"pg": "item", "trainer.inner['pg']": "item",
                     "trainer.inner['models'][1]": "item", "trainer.inner['models'][2][0]": "frozen",
                     "trainer.inner['slotted'].pg": "slot"}
    assert [s.assign("new") for s in w.hits[0].slots].count(False) == 1  # the tuple's
    assert ns["pg"] == outer.inner["pg"] == outer.inner["models"][1] == slotted.pg == "new"
    assert ns["_hidden"] is OLD and outer.inner["models"][2][0] is OLD


def test_module_children_read_as_attributes_one_level_each():
    class Module:
        def __init__(self, child=None):
            self._modules = {"child": child} if child is not None else {}

    leaf = Module()
    leaf.pg = OLD
    net = leaf
    for _ in range(20):  # 20 modules deep: 21 levels, 41 if each _modules dict were one
        net = Module(net)
    w = walk({"net": net}, classify, max_depth=24)
    assert w.hits and w.hits[0].path == "net" + ".child" * 20 + ".pg"


def test_the_bounds_stop_the_walk_and_say_so():
    chain = head = {}
    for _ in range(30):
        chain["next"] = {}
        chain = chain["next"]
    chain["pg"] = OLD
    deep = walk({"head": head}, classify, max_depth=10)
    assert deep.truncated and not deep.hits
    wide = walk({"many": [object() for _ in range(500)] + [OLD]}, classify, max_objects=100)
    assert wide.truncated and wide.seen == 100
    whole = walk({"head": head}, classify, max_depth=40)
    assert not whole.truncated and whole.hits


def test_standard_library_objects_are_not_walked_into():
    log = logging.getLogger("objwalk-test")
    log.pg = OLD  # a logger leads to every logger of the process: never followed
    w = walk({"log": log}, classify)
    assert not w.hits and w.seen == 1
