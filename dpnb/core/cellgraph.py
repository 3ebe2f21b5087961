"""Which cells built a name: what ``restart --resume`` must replay.  Pure (ast only).

A notebook builds its model and data in ordinary cells, one reading names an
earlier one bound (``hidden = 64`` ... ``net = Net(hidden)``).  When an engine
dies, its replacement starts empty; the wrap and the data need their names
again.  From the history of cells this module finds the ones to run again:
for each needed name, the *last* cell that bound it, the later cells that
changed that object in place (``net.fc = ...``, ``net.load_state_dict(...)``),
and, the same way, the names those cells read -- as of each cell's place in
the history.  Cells marked ``%%dp --setup`` are always replayed.

A cell is never replayed silently when it failed, ran on some ranks only or
is not plain Python (a ``!shell`` or ``%magic`` line): the plan says why it
was left out, and a needed name whose last binding was such a cell -- or that
no cell bound -- is *missing*, so the resume can refuse before it replaces
anything.  A cell that calls a collective or builds DDP/FSDP must run on
every rank at once (``everywhere``).
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from typing import Mapping, Sequence

#: calls that make a cell a collective: it runs on every rank or on none
COLLECTIVE_CALLS = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "broadcast_object_list",
    "gather_object", "scatter_object_list", "monitored_barrier", "reduce_scatter_single",
    "all_gather_single", "new_group", "init_device_mesh", "DistributedDataParallel", "DDP",
    "fully_shard", "ZeroRedundancyOptimizer",
})
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class CellFacts:
    """What one cell does to the namespace, read from its source."""

    binds: frozenset = frozenset()    # names it (re)binds at the top level
    touches: frozenset = frozenset()  # names whose object it changes in place
    reads: frozenset = frozenset()    # names it reads as it runs, and does not bind itself
    later: frozenset = frozenset()    # names its functions and classes read when called
    everywhere: bool = False          # calls a collective / builds DDP or FSDP
    problem: str = ""                 # why it can never be replayed ("" if it can)


@dataclass(frozen=True)
class HistoryCell:
    """A cell as the history kept it (``ranks`` None: every rank)."""

    index: int
    code: str
    ok: bool = True
    ranks: tuple | None = None
    setup: bool = False


@dataclass(frozen=True)
class Replay:
    index: int
    code: str
    why: str  # "marked --setup" / "binds net, needed by the wrap"
    everywhere: bool = False


@dataclass(frozen=True)
class ResumePlan:
    cells: tuple = ()        # Replay, in history order
    left_out: tuple = ()     # (cell summary, why), cells seen and not replayed
    missing: tuple = ()      # (name, why it is needed, what to do)
    unbound: tuple = field(default=())  # names some replayed cell reads that no cell binds

    @property
    def ok(self) -> bool:
        return not self.missing


#: methods that change a module's structure, dtype or trainable set in place;
#: calls of them as top-level statements count as changing the object (the
#: checkpoint restores values, not these)
RESHAPING_METHODS = frozenset({"requires_grad_", "half", "float", "double", "bfloat16", "to",
                               "add_module", "register_module", "register_buffer",
                               "register_parameter", "apply"})


class _Scan(ast.NodeVisitor):
    """Top-level bindings, in-place changes and reads of one cell."""

    def __init__(self) -> None:
        self.binds: set[str] = set()
        self.touches: set[str] = set()
        self.loads: set[str] = set()
        self.later: set[str] = set()  # read inside def / class bodies: when they are used
        self.everywhere = False
        self.depth = 0  # always 0: def and class bodies are read whole by _scope
        self.loops = 0  # inside a loop: a training loop's calls change nothing to rebuild

    def visit_Name(self, n: ast.Name) -> None:
        if isinstance(n.ctx, ast.Load):
            self.loads.add(n.id)
        elif self.depth == 0:
            self.binds.add(n.id)

    def visit_Attribute(self, n: ast.Attribute) -> None:
        if isinstance(n.ctx, ast.Store) and self.depth == 0:  # net.fc = nn.Linear(...)
            base = _base_name(n)
            if base:
                self.touches.add(base)
        self.generic_visit(n)

    visit_Subscript = visit_Attribute

    def visit_Import(self, n: ast.Import) -> None:
        for a in n.names:
            if self.depth == 0:
                self.binds.add((a.asname or a.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def _scope(self, n) -> None:
        """A def or class: binds its name; what it reads is what its body reads
        from outside (parameters and its own assignments are its own)."""
        if self.depth == 0:
            self.binds.add(n.name)
        for d in n.decorator_list:
            self.visit(d)
        for b in getattr(n, "bases", []):
            self.visit(b)
        args = getattr(n, "args", None)
        if args is not None:
            for default in [*args.defaults, *[d for d in args.kw_defaults if d is not None]]:
                self.visit(default)
        own = {a.arg for x in ast.walk(n) if isinstance(x, ast.arguments)
               for a in [*x.posonlyargs, *x.args, *x.kwonlyargs,
                         *[v for v in (x.vararg, x.kwarg) if v is not None]]}
        own |= {x.id for x in ast.walk(n) if isinstance(x, ast.Name)
                and isinstance(x.ctx, (ast.Store, ast.Del))}
        own |= {x.name for x in ast.walk(n) if x is not n and isinstance(
            x, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        loads = {x.id for x in ast.walk(n) if isinstance(x, ast.Name)
                 and isinstance(x.ctx, ast.Load)} - own
        if isinstance(n, ast.ClassDef):  # a class body runs now; its methods' bodies later
            defs = [f for f in n.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            later = _names([stmt for f in defs for stmt in f.body])
            now = _names([f for f in n.body if f not in defs]) | _names(
                [x for f in defs for x in [*f.decorator_list, *f.args.defaults,
                                           *[d for d in f.args.kw_defaults if d is not None]]])
            self.loads |= now & loads
            self.later |= (later - now) & loads
        else:
            self.later |= loads

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def _loop(self, n) -> None:
        self.loops += 1
        self.generic_visit(n)
        self.loops -= 1

    visit_For = visit_While = visit_AsyncFor = _loop

    def visit_Expr(self, n: ast.Expr) -> None:
        # `net.requires_grad_(False)`, `net.apply(init)` as a statement reshape net
        call = n.value
        if self.depth == 0 and not self.loops and isinstance(call, ast.Call) \
                and isinstance(call.func, ast.Attribute) and call.func.attr in RESHAPING_METHODS:
            base = _base_name(call.func.value)
            if base:
                self.touches.add(base)
        self.generic_visit(n)

    def visit_Call(self, n: ast.Call) -> None:
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name in COLLECTIVE_CALLS:
            self.everywhere = True
        self.generic_visit(n)


def _names(nodes) -> set[str]:
    """Names read anywhere in ``nodes``."""
    return {x.id for node in nodes for x in ast.walk(node)
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def facts(code: str) -> CellFacts:
    """What ``code`` binds, changes and reads (a cell that is not plain Python: ``problem``)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return CellFacts(problem="it is not plain Python (a !shell or %magic line): replaying "
                                 "it could run a command again")
    s = _Scan()
    s.visit(tree)
    return CellFacts(binds=frozenset(s.binds), touches=frozenset(s.touches - s.binds),
                     reads=frozenset(s.loads - s.binds - _BUILTINS),
                     later=frozenset(s.later - s.loads - s.binds - _BUILTINS),
                     everywhere=s.everywhere)


def cell_summary(code: str) -> str:
    """A cell in a few words: its first line (60 characters) and how many follow."""
    lines = [ln.strip() for ln in code.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return lines[0][:60] + (f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "")


def _unusable(c: HistoryCell, f: CellFacts) -> str:
    if not c.ok:
        return "it failed on a rank"
    if c.ranks is not None:
        return f"it ran on rank{'s' if len(c.ranks) > 1 else ''} {','.join(map(str, c.ranks))} only"
    return f.problem


def plan(cells: Sequence[HistoryCell], needed: Mapping[str, str],
         provided: frozenset = frozenset()) -> ResumePlan:
    """The cells to replay so that every name in ``needed`` (name -> who needs
    it) is built again, plus the cells marked ``--setup``.  ``provided``: names
    every rank has without any cell (``rank``, ``torch``, ...)."""
    cells = sorted(cells, key=lambda c: c.index)
    info = {c.index: facts(c.code) for c in cells}
    chosen: dict[int, str] = {}
    left: dict[int, str] = {}
    missing: list[tuple[str, str, str]] = []
    unbound: set[str] = set()
    todo = [(name, why, len(cells), True) for name, why in needed.items()]
    todo += [(None, "marked --setup", i, False) for i, c in enumerate(cells) if c.setup and c.ok]
    seen: set[tuple] = set()
    while todo:
        name, why, before, root = todo.pop()
        if (name, before) in seen:
            continue
        seen.add((name, before))
        if name is None:  # a marked cell: replay it, and what it reads
            picked = [before]
        else:
            picked = _builders(cells, info, name, before, left)
            if picked is None:
                if root:
                    missing.append((name, why, _advice(cells, info, name, before)))
                elif name not in provided:
                    unbound.add(name)
                continue
        for pos in picked:
            c = cells[pos]
            chosen.setdefault(c.index, why if name is None else f"binds {name}, needed by {why}")
            for r in sorted(info[c.index].reads - provided):
                todo.append((r, f"cell {c.index}", pos, False))
            # a function's body reads its names when it is called: as of its user
            for r in sorted(info[c.index].later - provided):
                todo.append((r, f"cell {c.index}", max(before, pos + 1), False))
    replays = tuple(Replay(c.index, c.code, chosen[c.index], info[c.index].everywhere)
                    for c in cells if c.index in chosen)
    return ResumePlan(cells=replays,
                      left_out=tuple((cell_summary(c.code) or "(empty)", left[c.index]) for c in cells
                                     if c.index in left and c.index not in chosen),
                      missing=tuple(missing), unbound=tuple(sorted(unbound)))


def _builders(cells, info, name, before, left) -> list[int] | None:
    """Positions of the last cell before ``before`` binding ``name`` and of the
    later ones changing it in place; None when that binding cannot be replayed."""
    for pos in range(before - 1, -1, -1):
        c, f = cells[pos], info[cells[pos].index]
        if name not in f.binds:
            continue
        why = _unusable(c, f)
        if why:
            left[c.index] = why
            return None
        out = [pos]
        for later in range(pos + 1, before):
            lc, lf = cells[later], info[cells[later].index]
            if name in lf.touches:
                lwhy = _unusable(lc, lf)
                if lwhy:
                    left[lc.index] = lwhy
                else:
                    out.append(later)
        return out
    return None


def _advice(cells, info, name, before) -> str:
    for pos in range(before - 1, -1, -1):
        c, f = cells[pos], info[cells[pos].index]
        if name in f.binds:
            return (f"its last binding, cell {c.index}, cannot be replayed ({_unusable(c, f)}): "
                    f"run {name} = ... again in a plain %%dp cell on every rank")
    return (f"no cell in the history binds it: define {name} in a %%dp cell on every rank "
            f"(or mark the cell that builds it with %%dp --setup)")
