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

from dpnb.engine.cell.collcheck import COLLECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
             "zeros_like", "ones_like"}


def _on_cpu_device(node: ast.AST) -> bool:
    """``"cpu"`` or ``torch.device("cpu")``."""
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "device" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "cpu")


def _is_factory(node: ast.AST) -> bool:
    """``torch.<factory>(...)`` with no ``device=``, or ``device="cpu"``
    (``*_like`` copy the device: fine)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and node.func.attr in FACTORIES and not node.func.attr.endswith("_like")):
        return False
    device = [k.value for k in node.keywords if k.arg == "device"]
    return not device or _on_cpu_device(device[0])


def _moved_to_cpu(node: ast.AST) -> bool:
    """``x.cpu()``, ``x.to("cpu")``, ``x.to(device="cpu")``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr == "cpu":
        return True
    where = node.args[:1] + [k.value for k in node.keywords if k.arg == "device"]
    return node.func.attr == "to" and any(_on_cpu_device(w) for w in where)


def _cpu_tensor(node: ast.AST, made: dict[str, int]) -> bool:
    """An expression that is (or holds, in a list / tuple / comprehension) a
    tensor on the CPU: a deviceless factory, a move to the CPU, a name bound
    to one."""
    if isinstance(node, ast.Name):
        return node.id in made
    if isinstance(node, ast.Starred):
        return _cpu_tensor(node.value, made)
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_cpu_tensor(x, made) for x in node.elts)
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return _cpu_tensor(node.elt, made)
    return _is_factory(node) or _moved_to_cpu(node)


def _cpu_tensors_in_collectives(tree: ast.AST, cell: bool = False) -> list[str]:
    """``what (line)`` for each CPU tensor reaching a collective in the same
    scope (each function body; for a cell, the cell too): named or inline,
    positional or keyword, alone or in a list."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef) + ((ast.Module,) if cell else ())
    scopes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    bad = []
    for scope in scopes:
        made: dict[str, int] = {}
        assigns = sorted((n for n in ast.walk(scope) if isinstance(n, ast.Assign)),
                         key=lambda n: n.lineno)
        for n in assigns:
            cpu = _cpu_tensor(n.value, made)
            for t in n.targets:
                if isinstance(t, ast.Name) and cpu:
                    made[t.id] = n.lineno
                elif isinstance(t, ast.Name):  # rebound to something else: no longer ours to judge
                    made.pop(t.id, None)
        for n in ast.walk(scope):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in COLLECTIVES):
                continue
            for arg in list(n.args) + [k.value for k in n.keywords]:
                if _cpu_tensor(arg, made):
                    what = arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)
                    where = f"made line {made[arg.id]}, " if isinstance(arg, ast.Name) else ""
                    bad.append(f"{what} ({where}{n.func.attr} line {n.lineno})")
    return bad


#: engine modules that run on gloo groups only, where CPU tensors are right
GLOO_ONLY = {"p2pcheck.py": "point-to-point checks run on gloo only (cellguard: guard.p2p)"}


def test_engine_code_makes_collective_tensors_on_the_comm_device():
    bad = {}
    for p in sorted((ROOT / "dpnb" / "engine").glob("*.py")):
        if p.name in GLOO_ONLY:
            continue
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


def test_the_check_finds_the_mistake_however_it_is_written():
    """Keywords, inline factories, lists, ``.cpu()``, ``device="cpu"``: each a
    CPU tensor reaching an NCCL collective."""
    code = ("def f(x, es):\n"
            "    dist.all_reduce(tensor=torch.zeros(1))\n"                       # 2: keyword, inline
            "    dist.broadcast(torch.ones(2), src=0)\n"                         # 3: inline positional
            "    outs = [torch.empty(3) for _ in range(4)]\n"                    # 4: a list of them
            "    dist.all_gather(outs, x)\n"                                     # 5
            "    y = x.detach().cpu()\n"                                         # 6: moved to the CPU
            "    dist.all_reduce(y)\n"                                           # 7
            "    z = torch.full((2,), 1.0, device='cpu')\n"                      # 8: named cpu
            "    dist.reduce_scatter_tensor(output=z, input=x)\n"                # 9
            "    dist.all_gather([x.to('cpu'), x], x)\n"                         # 10
            "    ok = torch.zeros(1, device=es.comm_device)\n"
            "    dist.all_reduce(ok)\n")
    found = _cpu_tensors_in_collectives(ast.parse(code))
    lines = sorted(int(f.rsplit("line ", 1)[1].rstrip(")")) for f in found)
    assert lines == [2, 3, 5, 7, 9, 10], found
