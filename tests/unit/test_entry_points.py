"""Every engine function the notebook calls by dotted name exists.

The notebook side never pickles a closure: it sends ``"dpnb.engine.views.
set_straggle"`` and the engine imports and calls it.  A typo, or a function
renamed on one side only, would surface only when a user runs that view on
a live cluster.  Here every such name written in dpnb's source (a string
constant ``dpnb.engine.<module>[.<function>]`` anywhere but a logger's name)
is resolved the way an engine resolves it.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[2] / "dpnb"
NAME = re.compile(r"dpnb\.engine(\.[A-Za-z_]\w*)+")


def _names() -> dict[str, str]:
    out: dict[str, str] = {}
    for p in PKG.rglob("*.py"):
        tree = ast.parse(p.read_text())
        loggers = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and getattr(n.func, "attr", getattr(n.func, "id", "")) == "getLogger"
                   for a in n.args}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and NAME.fullmatch(n.value) and id(n) not in loggers:
                out.setdefault(n.value, f"{p.relative_to(PKG.parent)}:{n.lineno}")
    return out


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_dotted_engine_name_resolves():
    names = _names()
    assert len(names) >= 20, names  # the scan finds the calls (views, training, checkpoint...)
    broken = {}
    for dotted, where in sorted(names.items()):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            broken[dotted] = f"{where}: {type(e).__name__}: {e}"
    assert not broken, broken
