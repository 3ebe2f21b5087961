"""Every engine function the notebook calls by name exists, and is named in one place.

The notebook side never pickles a closure: it sends ``"dpnb.engine.metrics.views.
set_straggle"`` and the engine imports and calls it.  A typo, or a function
renamed on one side only, would surface only when a user runs that view on
a live cluster.  The names live in :mod:`dpnb.engine.entrypoints`; every
caller outside ``dpnb/engine`` imports them from there (``ep.TRAIN``), so
here each one is resolved the way an engine resolves it, and no other
module outside the engine spells one as a string (nor a prefix to glue a
name onto, as ``"dpnb.engine.train.training." + "train"`` once did).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

from dpnb.engine import entrypoints

PKG = pathlib.Path(__file__).resolve().parents[2] / "dpnb"
NAME = re.compile(r"dpnb\.engine(\.[A-Za-z_]\w*)+")
#: a dotted engine name, or the start of one (``"dpnb.engine.train.training."``)
SPELLED = re.compile(r"dpnb\.engine\.([A-Za-z_]\w*\.?)*")


def _strings(tree: ast.AST):
    """Every string constant but docstrings and logger names, with its line."""
    skip = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) == "getLogger" for a in n.args}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and n.body and isinstance(n.body[0], ast.Expr) \
                and isinstance(n.body[0].value, ast.Constant):
            skip.add(id(n.body[0].value))
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip:
            yield n.value, n.lineno


def _names() -> dict[str, str]:
    """Every dotted engine name written anywhere in dpnb (the engine's own included)."""
    out: dict[str, str] = {}
    for p in PKG.rglob("*.py"):
        for s, line in _strings(ast.parse(p.read_text())):
            if NAME.fullmatch(s):
                out.setdefault(s, f"{p.relative_to(PKG.parent)}:{line}")
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


def test_every_named_entry_point_resolves():
    names = entrypoints.all_names()
    assert len(names) >= 30, names  # the calls: runtime, training, checkpoint, views...
    broken = {}
    for const, dotted in sorted(names.items()):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            broken[const] = f"{dotted}: {type(e).__name__}: {e}"
    assert not broken, broken


def test_every_dotted_engine_name_resolves():
    """The engine's own dotted strings too (its messages name functions to call)."""
    # the names a kept record may hold from before the engine's rooms: read back, never called
    names = {k: v for k, v in _names().items() if k not in entrypoints.RENAMED}
    assert len(names) >= 20, names
    broken = {}
    for dotted, where in sorted(names.items()):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            broken[dotted] = f"{where}: {type(e).__name__}: {e}"
    assert not broken, broken


def test_no_module_outside_the_engine_spells_an_entry_point():
    """Outside ``dpnb/engine/``, ``cluster.call(ep.TRAIN)``, never ``"dpnb.engine..."``
    (docstrings may name functions for the reader; they are not calls)."""
    by_value = {v: k for k, v in entrypoints.all_names().items()}
    spelled = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent)
        if rel.parts[1] == "engine":
            continue
        for s, line in _strings(ast.parse(p.read_text())):
            for m in SPELLED.finditer(s):
                name = m.group(0)
                use = f"ep.{by_value[name]}" if name in by_value else \
                    "a new constant in dpnb/engine/entrypoints.py"
                spelled.append(f"{rel}:{line} {name!r} -> {use} "
                               f"(from dpnb.engine import entrypoints as ep)")
    assert not spelled, "move these engine names to dpnb.engine.entrypoints:\n" + "\n".join(spelled)
