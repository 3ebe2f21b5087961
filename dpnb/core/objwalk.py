"""A bounded walk from a namespace into the objects its names hold.

Used after a re-formation (:mod:`dpnb.engine.group.rebind`) to find every object
that still holds the destroyed process group, wherever the user's code or a
library put it: ``trainer.model_wrapped``, ``fabric_model._forward_module``,
``models[1]``, ``cfg['opt']``.  The walk knows no library; the caller's
``classify`` says what an object is and whether to look inside it.

What it follows, and only that: an instance's ``__dict__`` (read through the
C-level descriptor, so a class that makes ``__dict__`` a property is not
called), its ``__slots__`` (through their member descriptors), and the items
of lists, tuples, sets and dicts (dict values; ``dict.items`` of the base
class, so an overridden ``items`` or ``__iter__`` is not called).  It never
calls ``getattr`` on an arbitrary name: a property, a ``__getattr__`` or a
lazy attribute could run code -- even a collective -- on one rank only.
Modules, classes, functions, methods and instances of standard-library
classes (loggers, locks, threads) are leaves.  Each object is visited
once (by ``id``, so cycles end), breadth first (the first path found is the
shortest), at most ``max_depth`` deep and ``max_objects`` in all.
"""

from __future__ import annotations

import sys
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

#: never looked into: they hold no user objects worth following, or too many
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, memoryview, range,
           type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.CodeType, types.FrameType, types.GeneratorType,
           types.CoroutineType, types.TracebackType)

#: an nn.Module's dicts whose entries read as its attributes (``net.fc``, ``net.fc.weight``)
_AS_ATTR = ("._modules", "._parameters", "._buffers")

#: ``classify(obj) -> (kind or None, what to follow)``: True (everything),
#: False (nothing), or a tuple of attribute names to follow
Classify = Callable[[Any], "tuple[str | None, bool | tuple[str, ...]]"]


@dataclass
class Slot:
    """One place an object sits: its holder, the key there, and how to assign it.

    ``how``: ``attr`` (the holder's ``__dict__``), ``slot`` (a ``__slots__``
    member, ``key`` is its descriptor), ``item`` (a list or dict), ``frozen``
    (a tuple, set or frozenset: cannot be assigned in place).
    """

    holder: Any
    key: Any
    how: str
    path: str

    def assign(self, value: Any) -> bool:
        """Put ``value`` where the object was; False where that cannot be done."""
        if self.how == "attr" or self.how == "item":
            self.holder[self.key] = value
        elif self.how == "slot":
            self.key.__set__(self.holder[0], value)
        else:
            return False
        return True


@dataclass
class Hit:
    """An object ``classify`` named, with every place the walk saw it."""

    obj: Any
    kind: str
    slots: list[Slot] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.slots[0].path


@dataclass
class Walk:
    hits: list[Hit]
    seen: int
    truncated: bool  # the bounds stopped it: deeper or further objects were not looked at
    max_depth: int = 0
    max_objects: int = 0


def _stdlib_leaf(obj: Any) -> bool:
    """An instance of a standard-library class (a logger, a lock, a thread, a
    socket): it holds no torch object of the user's, and a logger leads to
    every logger of the process.  Containers are walked before this is asked;
    ``SimpleNamespace`` is a holder people fill themselves."""
    if isinstance(obj, types.SimpleNamespace):
        return False
    root = (getattr(type(obj), "__module__", None) or "").partition(".")[0]
    return root in sys.stdlib_module_names


def instance_dict(obj: Any) -> dict | None:
    """``obj.__dict__`` read through the interpreter's own descriptor (None if
    the class has none, or replaced it by something that would run code)."""
    for klass in type(obj).__mro__:
        desc = vars(klass).get("__dict__")
        if desc is not None:
            if isinstance(desc, types.GetSetDescriptorType):
                d = desc.__get__(obj, type(obj))
                return d if isinstance(d, dict) else None
            return None
    return None


def _slot_values(obj: Any) -> Iterator[tuple[str, Any, Any]]:
    for klass in type(obj).__mro__:
        names = vars(klass).get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            desc = vars(klass).get(name)
            if isinstance(desc, types.MemberDescriptorType):
                try:
                    yield name, desc, desc.__get__(obj, type(obj))
                except AttributeError:  # a slot never assigned
                    continue


def _key(k: Any) -> str:
    text = repr(k)
    return text if len(text) <= 40 else text[:37] + "..."


def children(obj: Any, path: str, follow: bool | tuple[str, ...]) -> Iterator[tuple[Any, Slot]]:
    """What ``obj`` holds, each with the slot it sits in (no user code runs)."""
    if follow is False:
        return
    names = None if follow is True else set(follow)
    if isinstance(obj, dict):
        # an nn.Module's children, parameters and buffers read as attributes
        as_attr = path.endswith(_AS_ATTR)
        base = path.rsplit(".", 1)[0] if as_attr else path
        for k, v in list(dict.items(obj)):
            sub = f"{base}.{k}" if as_attr and isinstance(k, str) else f"{path}[{_key(k)}]"
            yield v, Slot(obj, k, "item", sub)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        how = "item" if isinstance(obj, list) else "frozen"
        seq = list.__iter__(obj) if isinstance(obj, list) else iter(tuple(obj))
        for i, v in enumerate(seq):
            yield v, Slot(obj, i, how, f"{path}[{i}]")
        return
    if _stdlib_leaf(obj):
        return
    d = instance_dict(obj)
    if d is not None:
        for k, v in list(dict.items(d)):
            if isinstance(k, str) and (names is None or k in names):
                yield v, Slot(d, k, "attr", f"{path}.{k}")
    for name, desc, v in _slot_values(obj):
        if names is None or name in names:
            yield v, Slot((obj,), desc, "slot", f"{path}.{name}")


def walk(roots: Mapping[str, Any], classify: Classify, *, names: Iterable[str] | None = None,
         max_depth: int = 16, max_objects: int = 100_000) -> Walk:
    """Every object under ``roots`` that ``classify`` names, breadth first.

    ``roots`` is a namespace (name -> object), walked from ``names`` (default:
    all); a root's slot is its name in ``roots``, so a hit can rebind the name
    itself.  An object met again on
    another path is not walked again, but a hit records every slot it was seen
    in (a group object held in three places is replaced in all three).
    """
    hits: dict[int, Hit] = {}
    seen: set[int] = set()
    queue: deque = deque()
    for name in list(roots) if names is None else names:
        queue.append((roots[name], Slot(roots, name, "item", name), 0))
    truncated = False
    while queue:
        obj, slot, depth = queue.popleft()
        if isinstance(obj, _LEAVES):
            continue
        if id(obj) in hits:
            hits[id(obj)].slots.append(slot)
            continue
        if id(obj) in seen:
            continue
        if len(seen) >= max_objects:
            truncated = True
            break
        seen.add(id(obj))
        kind, follow = classify(obj)
        if kind is not None:
            hits[id(obj)] = Hit(obj, kind, [slot])
        if depth >= max_depth:
            truncated = truncated or any(True for _ in children(obj, slot.path, follow))
            continue
        # an nn.Module's child dict is no level of its own: ``net.encoder`` is one step
        step = 0 if slot.path.endswith(_AS_ATTR) else 1
        for child, sub in children(obj, slot.path, follow):
            queue.append((child, sub, depth + step))
    return Walk(list(hits.values()), len(seen), truncated, max_depth, max_objects)
