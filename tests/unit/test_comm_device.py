"""Tensors given to a collective are made on the communication device.

An NCCL group reduces GPU tensors only ("No backend type associated with
device type cpu"), so a tensor made with ``torch.tensor(...)`` and no
``device=`` breaks the call on the first machine with two GPUs -- while every
CPU run passes.  No GPU here, so this reads the code: in each function of
``dpnb/engine`` and in each code cell of the course, a name bound to a
tensor factory without ``device=`` must not be passed to a collective.
"""

from __future__ import annotations

import ast
import json
import pathlib

from dpnb.engine.collcheck import COLLECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
             "zeros_like", "ones_like"}


def _is_factory(node: ast.AST) -> bool:
    """``torch.<factory>(...)`` with no ``device=`` (``*_like`` copy the device: fine)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and node.func.attr in FACTORIES and not node.func.attr.endswith("_like")
            and not any(k.arg == "device" for k in node.keywords))


def _cpu_tensors_in_collectives(tree: ast.AST, cell: bool = False) -> list[str]:
    """``name (line)`` for each factory-made, deviceless name passed to a collective
    in the same scope (each function body; for a cell, the cell too)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef) + ((ast.Module,) if cell else ())
    scopes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    bad = []
    for scope in scopes:
        made: dict[str, int] = {}
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and _is_factory(n.value):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        made[t.id] = n.lineno
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in made
                                                   for t in n.targets):
                for t in n.targets:  # rebound to something else: no longer ours to judge
                    if isinstance(t, ast.Name):
                        made.pop(t.id, None)
        for n in ast.walk(scope):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in COLLECTIVES and n.args
                    and isinstance(n.args[0], ast.Name) and n.args[0].id in made):
                bad.append(f"{n.args[0].id} (made line {made[n.args[0].id]}, "
                           f"{n.func.attr} line {n.lineno})")
    return bad


def test_engine_code_makes_collective_tensors_on_the_comm_device():
    bad = {}
    for p in sorted((ROOT / "dpnb" / "engine").glob("*.py")):
        found = _cpu_tensors_in_collectives(ast.parse(p.read_text()))
        if found:
            bad[p.name] = found
    assert not bad, f"create these on es.comm_device: {bad}"


def test_course_cells_make_collective_tensors_on_device():
    bad = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            code = "\n".join(line for line in src.splitlines()
                             if not line.lstrip().startswith(("%", "!")))
            try:
                tree = ast.parse(code)
            except SyntaxError:
                continue
            found = _cpu_tensors_in_collectives(tree, cell=True)
            if found:
                bad[f"{nb.name} cell {i}"] = found
    assert not bad, f"create these with device=device: {bad}"


def test_the_check_finds_the_mistake_it_is_for():
    # the save path's agreement flag as it was written before (CPU under NCCL)
    code = ("def save(ns):\n    has = torch.tensor([1])\n"
            "    dist.all_reduce(has, op=dist.ReduceOp.MIN)\n")
    assert _cpu_tensors_in_collectives(ast.parse(code)) == ["has (made line 2, all_reduce line 3)"]
    ok = code.replace("torch.tensor([1])", "torch.tensor([1], device=es.comm_device)")
    assert _cpu_tensors_in_collectives(ast.parse(ok)) == []
