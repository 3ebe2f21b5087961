"""Every import inside a function says why it is there, and the reasons hold.

A lazy import hides a dependency from the top of its module, so each one
carries a comment (on its line, or above its run of imports).  Three of
those reasons are promises about what importing a module costs, and each is
checked here against a fresh interpreter:

* ``import dpnb`` (and the runtime, the session, the CLI) loads no torch,
  IPython, ipyparallel, ipywidgets or matplotlib: a notebook's
  ``%load_ext dpnb`` and ``dpnb --help`` stay quick;
* the engine modules marked torch-free import without torch: the engine's
  boot imports them while torch loads in a background thread, so the engine
  registers with the controller before torch is ready (``engine/boot.py``);
* the modules marked FSDP-lazy import without ``torch.distributed.fsdp``: a
  DDP job on more engines than cores does not pay FSDP's import.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PKG = REPO / "dpnb"
HEAVY = ("torch", "IPython", "ipyparallel", "ipywidgets", "matplotlib")
LIGHT_REASON = "# lazy: `import dpnb` stays free of"
TORCH_FREE_REASON = "# lazy: torch-free at import"
FSDP_REASON = "# lazy: FSDP/DTensor load only for the strategy that uses them"
#: the client modules a newcomer's first line touches, whatever they say
ALWAYS_LIGHT = ("dpnb", "dpnb.cluster", "dpnb.session", "dpnb.cli")


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _lazy_imports(tree: ast.AST):
    seen = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in seen:
                    seen.add(id(n))
                    yield n


def _has_reason(lines: list[str], node: ast.stmt, starts: dict[int, ast.stmt]) -> bool:
    if "#" in lines[node.lineno - 1]:
        return True
    first = node.lineno
    # walk up over the run of imports this one belongs to
    while True:
        above = [n for n in starts.values() if n.end_lineno == first - 1]
        if not above:
            break
        first = above[0].lineno
    return first >= 2 and lines[first - 2].strip().startswith("#")


def test_every_lazy_import_says_why():
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        nodes = list(_lazy_imports(ast.parse("\n".join(lines))))
        starts = {n.lineno: n for n in nodes}
        missing += [f"{path.relative_to(REPO)}:{n.lineno}: {lines[n.lineno - 1].strip()}"
                    for n in nodes if not _has_reason(lines, n, starts)]
    assert not missing, ("an import inside a function needs a one-line reason (a comment on "
                         "its line or above its run of imports), or move it to the top:\n"
                         + "\n".join(missing))


def _claiming(reason: str) -> list[str]:
    return sorted(_module(p) for p in PKG.rglob("*.py") if reason in p.read_text())


def _loaded_after_import(modules: list[str], watch: tuple[str, ...]) -> list[str]:
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            f"print(' '.join(w for w in {watch!r} if w in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("reason,watch,extra", [
    (LIGHT_REASON, HEAVY, ALWAYS_LIGHT),
    (TORCH_FREE_REASON, ("torch",), ()),
    (FSDP_REASON, ("torch.distributed.fsdp",), ()),
], ids=["light", "torch-free", "fsdp-lazy"])
def test_the_modules_that_claim_a_light_import_keep_it(reason, watch, extra):
    modules = sorted(set(_claiming(reason)) | set(extra))
    assert len(modules) >= 2, f"nothing claims {reason!r} any more: drop the check or the reason"
    loaded = _loaded_after_import(modules, watch)
    assert not loaded, (f"importing {', '.join(modules)} loaded {', '.join(loaded)}, "
                        f"though they say {reason!r}: keep the import inside the function")
