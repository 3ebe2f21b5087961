"""The layering of dpnb/, read from the source: no import cycles, and no upward imports.

Every ``import`` counts, module-level or inside a function (a lazy import is
still a dependency); only ``if TYPE_CHECKING:`` blocks are left out.  The
layers, bottom up (see docs/architecture.md):

0. leaves: ``core`` (pure), ``errors``, ``env``, ``log``, ``ranks``, ``compat``, ``ippcompat``, ``data``
1. ``engine`` -- runs on the ranks
2. ``cluster`` -- the engines runtime, which knows nothing of training
3. ``session`` (the training session), ``progress``, ``display``, ``widgets``, ``quiz``
4. ``magics``, ``demo``, ``cli``, the package ``dpnb`` itself
"""

from __future__ import annotations

import ast
import functools
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "dpnb"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


@functools.lru_cache(maxsize=None)
def _tree(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once per test process: the file's tests read
    the same 200-odd modules again and again (parsing them is about a second)."""
    return ast.parse(path.read_text())


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    tree = _tree(path)
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test):
            skip.update(id(x) for b in n.body for x in ast.walk(b))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        targets: list[str] = []
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")
                up = up[: len(up) - (n.level - 1)]
                base = ".".join(up + ([n.module] if n.module else []))
            # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in n.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("dpnb"):
                out.add(t)
    return out


@functools.lru_cache(maxsize=None)
def _read_graph() -> dict[str, frozenset[str]]:
    mods = _modules()
    return {m: frozenset(_imports(m, p, mods)) for m, p in mods.items()}


def _graph() -> dict[str, set[str]]:
    """Module -> the dpnb modules it imports (a fresh copy: a test may change its own)."""
    return {m: set(ts) for m, ts in _read_graph().items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _in(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    g = _graph()
    assert "dpnb.cluster.transport" in g and "dpnb.engine.train.step" in g
    assert "dpnb.cluster.diagnose" in g["dpnb.cluster"]  # a known edge is seen


def test_no_import_cycle_in_dpnb():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_core_imports_only_core():
    bad = {m: sorted(t for t in ts if not _in(t, "dpnb.core"))
           for m, ts in _graph().items() if _in(m, "dpnb.core")}
    assert not {m: t for m, t in bad.items() if t}


def test_leaves_import_no_higher_layer():
    leaves = ("dpnb.errors", "dpnb.env", "dpnb.log", "dpnb.ranks", "dpnb.compat", "dpnb.ippcompat",
              "dpnb.data")
    bad = {m: sorted(t for t in ts if not _in(t, "dpnb.core", *leaves))
           for m, ts in _graph().items() if _in(m, *leaves)}
    assert not {m: t for m, t in bad.items() if t}


def test_engine_imports_no_notebook_side():
    upper = ("dpnb.cluster", "dpnb.session", "dpnb.widgets", "dpnb.magics", "dpnb.progress",
             "dpnb.display", "dpnb.demo", "dpnb.cli", "dpnb.quiz", "dpnb.course", "dpnb.lab")
    bad = {m: sorted(t for t in ts if _in(t, *upper))
           for m, ts in _graph().items() if _in(m, "dpnb.engine")}
    assert not {m: t for m, t in bad.items() if t}


def test_widgets_never_import_cluster_or_train():
    bad = {m: sorted(t for t in ts if _in(t, "dpnb.cluster", "dpnb.session", "dpnb.magics"))
           for m, ts in _graph().items() if _in(m, "dpnb.widgets")}
    assert not {m: t for m, t in bad.items() if t}


#: the layers above the engines runtime
ABOVE_RUNTIME = ("dpnb.session", "dpnb.progress", "dpnb.display", "dpnb.widgets", "dpnb.quiz",
                 "dpnb.magics", "dpnb.demo", "dpnb.cli", "dpnb.course", "dpnb.lab")


def test_the_runtime_imports_nothing_above_it():
    """``dpnb.cluster`` knows nothing of training: no import of the session or the
    views, lazy ones included (the layer above extends it; it never calls up)."""
    bad = {m: sorted(t for t in ts if _in(t, *ABOVE_RUNTIME))
           for m, ts in _graph().items() if _in(m, "dpnb.cluster")}
    assert not {m: t for m, t in bad.items() if t}


#: the engine's training side, by room: a model, its data, its steps, its checkpoints
#: and peer copies (``train``), and what the views measure (``metrics``)
TRAINING_ROOMS = ("dpnb.engine.train", "dpnb.engine.metrics")
TRAINING = tuple(m for m in _modules() if _in(m, *TRAINING_ROOMS))


def test_the_runtime_imports_nothing_of_training():
    """``dpnb.cluster`` runs cells and calls and keeps ranks alive: it reaches no
    training module of the engine, directly or through the engine modules it
    does import (setup, runner, the side doors ...), and names no training
    entry point (``ep.TRAIN``, ``ep.WRAP`` are the session's to call)."""
    g = _graph()
    assert all(m in g for m in TRAINING), [m for m in TRAINING if m not in g]
    reached: dict[str, str] = {}
    todo = [(t, m) for m, ts in g.items() if _in(m, "dpnb.cluster") for t in ts]
    while todo:
        mod, via = todo.pop()
        if mod in reached or not _in(mod, "dpnb.engine"):
            continue
        reached[mod] = via
        todo += [(t, mod) for t in g[mod]]
    bad = {m: f"imported by {reached[m]}" for m in TRAINING if m in reached}
    from dpnb.engine import entrypoints as ep

    training_names = {k for k, v in ep.all_names().items() if v.startswith(tuple(m + "." for m in TRAINING))}
    for m, p in _modules().items():
        if _in(m, "dpnb.cluster"):
            for n in ast.walk(_tree(p)):
                if isinstance(n, ast.Attribute) and n.attr in training_names \
                        and ast.unparse(n.value) == "ep":
                    bad[f"{m}:{n.lineno}"] = ast.unparse(n)
    assert not bad, bad


def test_no_module_outside_the_runtime_touches_its_private_attributes():
    """``c._ipp``, ``cluster._check_running()``: the runtime's insides are its own.
    Read on the names the layers above give a cluster."""
    holders = {"c", "cluster", "self.cluster", "self._need()"}
    bad = []
    for m, p in _modules().items():
        if _in(m, "dpnb.cluster", "dpnb.engine", "dpnb.core"):
            continue
        for n in ast.walk(_tree(p)):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") \
                    and not n.attr.startswith("__") and ast.unparse(n.value) in holders:
                bad.append(f"{m}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_no_function_over_100_lines():
    """Code lines from ``def`` to the end, the docstring not counted (a long
    story of who communicates what is welcome; a long body is not)."""
    long = {}
    for p in PKG.rglob("*.py"):
        for n in ast.walk(_tree(p)):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            size = n.end_lineno - n.lineno + 1
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                size -= first.end_lineno - first.lineno + 1
            if size > 100:
                long[f"{p.relative_to(PKG.parent)}:{n.lineno} {n.name}"] = size
    assert not long, long


def test_no_module_keeps_an_instance_of_its_own_class():
    """No module-level singletons: a module that defines a class and makes one
    at import (``cache = _Cache()``) keeps state every caller shares and no
    caller owns; the owner holds it (a session, a server's handler)."""
    bad = []
    for p in PKG.rglob("*.py"):
        tree = _tree(p)
        own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for n in tree.body:
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Call) \
                    and isinstance(n.value.func, ast.Name) and n.value.func.id in own:
                bad.append(f"{p.relative_to(PKG.parent)}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


def test_rank_outcomes_are_compared_with_the_status_enum():
    """``o.status == "eror"`` would be silently false; ``Status.EROR`` fails at once.
    The same for the records' and the waits' kinds (``EntryKind``, ``WaitKind``)."""
    from dpnb.cluster.types import EntryKind, Status, WaitKind

    kinds = {k.value for k in (*EntryKind, *WaitKind)}
    statuses = {k.value for k in Status}
    bare = []
    for p in PKG.rglob("*.py"):
        for n in ast.walk(_tree(p)):
            if not isinstance(n, ast.Compare):
                continue
            consts = {c.value for c in n.comparators for c in ast.walk(c)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            sides = [n.left, *n.comparators]
            attrs = {x.attr if isinstance(x, ast.Attribute) else x.id for x in sides
                     if isinstance(x, (ast.Attribute, ast.Name))}
            if "status" in attrs and consts & statuses or "kind" in attrs and consts & kinds:
                bare.append(f"{p.relative_to(PKG.parent)}:{n.lineno}")
    assert not bare, bare


def test_every_module_is_named_in_the_architecture_doc():
    """Each file of every folder (``core/``, ``widgets/``, ``data/`` and the
    packages' ``__init__.py`` included) by its path, or by its name in a row
    that names its folder."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = []
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent)
        folder = "/".join(rel.parts[:-1]) + "/"
        rows = [line for line in doc.splitlines() if folder in line]
        if str(rel) not in doc and not any(f"`{p.name}`" in r for r in rows):
            missing.append(str(rel))
    assert not missing, f"add these to docs/architecture.md: {missing}"


#: outcomes a handler may expect and drop without a word: the folder exists,
#: the file or process is gone, the queue is empty
EXPECTED = {"FileExistsError", "FileNotFoundError", "ProcessLookupError",
            "psutil.NoSuchProcess", "queue.Empty"}


def test_no_exception_is_dropped_without_a_reason():
    """An ``except`` whose body only passes or continues catches an expected
    outcome, or says on its lines why dropping the error is right (the others
    log it with its cause, re-raise, or turn it into the caller's answer)."""
    silent = []
    for p in PKG.rglob("*.py"):
        lines = p.read_text().splitlines()
        for n in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(n, ast.ExceptHandler)
                    and all(isinstance(s, (ast.Pass, ast.Continue)) for s in n.body)):
                continue
            caught = n.type.elts if isinstance(n.type, ast.Tuple) else [n.type]
            if n.type is not None and all(ast.unparse(c) in EXPECTED for c in caught):
                continue
            span = lines[n.lineno - 1:n.body[-1].end_lineno]
            if not any("#" in line for line in span):
                silent.append(f"{p.relative_to(PKG.parent)}:{n.lineno}")
    assert not silent, f"log these (or say why not): {silent}"


def test_only_the_launchers_ask_a_launcher_s_name():
    """``if c.launcher == "slurm"`` scattered through the runtime is what the
    launcher classes replace (``dpnb/cluster/launchers/``); ``launch.py`` reads
    the user's ``--engines`` word once, at the start."""
    from dpnb.cluster.types import LAUNCHERS

    allowed = ("dpnb.cluster.launchers", "dpnb.cluster.launch")
    asked = []
    for m, p in _modules().items():
        if _in(m, *allowed):
            continue
        for n in ast.walk(_tree(p)):
            if not isinstance(n, ast.Compare):
                continue
            sides = [n.left, *n.comparators]
            names = {c.value for side in sides for c in ast.walk(side)
                     if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            subjects = [ast.unparse(x) for x in sides if isinstance(x, (ast.Name, ast.Attribute))]
            if names & set(LAUNCHERS) and any(x.endswith(("launcher", "engines"))
                                              for x in subjects):
                asked.append(f"{m}:{n.lineno} {ast.unparse(n)}")
    assert not asked, asked


def test_the_rank_table_changes_in_one_place():
    """Start, restart and resize hand a new table to ``Engines.adopt_ranks``; no
    other code writes a cluster's ``ranks`` (doors, deaths and the reaper
    would not follow).  A constructor keeping the list it is given is no write."""
    writes = []
    for m, p in _modules().items():
        tree = _tree(p)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name == "adopt_ranks":
                continue
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else \
                    [n.target] if isinstance(n, ast.AugAssign) else []
                for t in targets:
                    in_place = isinstance(t, ast.Subscript)
                    base = t.value if in_place else t
                    if not (isinstance(base, ast.Attribute) and base.attr == "ranks"):
                        continue
                    if in_place or ast.unparse(base.value) != "self" or fn.name != "__init__":
                        writes.append(f"{m}:{n.lineno} {ast.unparse(t)}")
    assert not writes, writes


#: the engine's rooms, bottom up: each may import the rooms before it, never one after
ENGINE_ROOMS = ("proc", "group", "debugging", "cell", "train", "metrics")
#: engine modules every room may import (they import no room themselves)
ENGINE_SHARED = ("dpnb.engine.state", "dpnb.engine.device", "dpnb.engine.entrypoints")


def _room(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[:2] != ["dpnb", "engine"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ENGINE_ROOMS else "top"


def test_the_engine_is_rooms_each_saying_what_it_owns():
    """At most 15 modules directly in ``dpnb/engine/``; every sub-package has a
    docstring that says what it owns and what it may import."""
    eng = PKG / "engine"
    direct = sorted(p.name for p in eng.glob("*.py"))
    assert len(direct) <= 15, direct
    rooms = sorted(p.name for p in eng.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ENGINE_ROOMS), rooms
    for r in rooms:
        doc = ast.get_docstring(_tree(eng / r / "__init__.py")) or ""
        assert "import" in doc and len(doc) > 120, f"dpnb/engine/{r}/__init__.py: say what it owns and may import"


def test_the_engine_rooms_import_only_downwards():
    """A room imports the rooms below it (``ENGINE_ROOMS``' order) and the shared
    modules; the shared modules import no room; the top-level modules (boot,
    setup, side door ...) no training room."""
    g = _graph()
    bad = []
    for m, ts in g.items():
        r = _room(m)
        if r is None:
            continue
        for t in ts:
            rt = _room(t)
            if rt is None or t in ENGINE_SHARED or rt == r:
                continue
            if m in ENGINE_SHARED:
                bad.append(f"{m} -> {t} (shared modules import no room)")
            elif r == "top":
                if rt in ("train", "metrics"):
                    bad.append(f"{m} -> {t}")
            elif rt == "top" or ENGINE_ROOMS.index(rt) > ENGINE_ROOMS.index(r):
                bad.append(f"{m} -> {t}")
    assert not bad, bad


def test_one_name_one_meaning():
    """At most one module named ``state.py`` and one class named ``Guard`` in dpnb."""
    states = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("state.py")]
    assert len(states) <= 1, states
    guards = [f"{p.relative_to(PKG.parent)}:{n.lineno}" for p in PKG.rglob("*.py")
              for n in ast.walk(_tree(p))
              if isinstance(n, ast.ClassDef) and n.name == "Guard"]
    assert len(guards) <= 1, guards


def test_no_train_function_takes_more_than_three_parameters():
    """The train call is one typed ``TrainArgs`` (``dpnb/core/trainargs.py``) across the
    rank boundary: every ``train`` in the engine and the session takes at most 3."""
    wide = []
    for p in [*(PKG / "engine").rglob("*.py"), *(PKG / "session").rglob("*.py")]:
        for n in ast.walk(_tree(p)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "train":
                a = n.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) \
                    + (a.vararg is not None) + (a.kwarg is not None)
                if count > 3:
                    wide.append(f"{p.relative_to(PKG.parent)}:{n.lineno} ({count})")
    assert not wide, wide


def test_the_ranks_health_is_written_only_by_its_own_methods():
    """``Health.dead`` / ``busy`` / ``group_ok``: the transport, the group, restart and
    status report what happened through ``Health``'s methods (``died``,
    ``still_busy``, ``group_broken`` ...); nothing else assigns or mutates them."""
    fields, mutators = {"dead", "busy", "group_ok"}, {"add", "discard", "pop", "clear", "update",
                                                      "remove", "setdefault", "popitem"}
    writes = []
    for m, p in _modules().items():
        tree = _tree(p)
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "Health":
                for x in ast.walk(cls):
                    x._health_own = True  # its own methods may
        for n in ast.walk(tree):
            if getattr(n, "_health_own", False):
                continue
            targets = n.targets if isinstance(n, ast.Assign) else \
                [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Attribute) and base.attr in fields \
                        and "health" in ast.unparse(base.value) or \
                        isinstance(base, ast.Attribute) and base.attr in fields \
                        and ast.unparse(base.value) == "h":
                    writes.append(f"{m}:{n.lineno} {ast.unparse(t)}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in mutators and isinstance(n.func.value, ast.Attribute) \
                    and n.func.value.attr in fields \
                    and ("health" in ast.unparse(n.func.value.value)
                         or ast.unparse(n.func.value.value) == "h"):
                writes.append(f"{m}:{n.lineno} {ast.unparse(n)}")
    assert not writes, writes
