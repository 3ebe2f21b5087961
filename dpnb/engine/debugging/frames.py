"""Telling the user's code from libraries on a rank's stack.

A rank stuck or failing somewhere is reported at *the user's* line -- a line
of the ``%%dp`` cell, or of a script run by ``%dp run`` or imported from the
user's own folder -- not at a frame inside torch or dpnb.  "Library" means a
file under the interpreter's standard library or site-packages, or dpnb's own
package; everything else is the user's.  Pure functions of frames, safe to
call from the side door's thread.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from typing import Any

from dpnb.core.paths import shown_path


@functools.lru_cache(maxsize=1)
def library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dpnb itself
    return tuple(sorted(r + os.sep for r in roots if r))


#: modules whose frames stepping passes over, in pdb on a rank and in JupyterLab's
#: debugger alike: the kernel and dpnb around a cell, so stepping goes from one
#: cell statement to the next; and torch.distributed's wrappers
STEP_SKIP = ("IPython.*", "ipykernel.*", "ipyparallel.*", "dpnb.*", "asyncio.*", "tornado.*",
             "zmq.*", "traitlets.*", "concurrent.*", "threading", "contextlib", "codeop",
             "runpy", "selectors", "queue", "torch.distributed.*")


def is_cell_statement(frame: Any) -> bool:
    """One top-level statement of a cell (IPython runs each as its own code object)."""
    return frame.f_code.co_name == "<module>" and is_cell(frame.f_code.co_filename)


def is_cell(filename: str) -> bool:
    """A ``%%dp`` cell's code (IPython names cells ``<ipython-input-...>`` or,
    in a kernel, a temporary ``ipykernel_<pid>/<hash>.py``)."""
    return filename.startswith("<ipython-input") or filename.startswith("<cell") or \
        ("ipykernel_" in filename and filename.endswith(".py"))


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    if is_cell(filename):
        return False
    return filename.startswith("<") or filename.startswith(library_roots())


def label(frame: Any, lineno: int | None = None) -> str:
    """``cell line 3`` or ``a/train.py line 42``: a file by its path below the
    engine's folder (the notebook's, for local engines), else in full -- two
    scripts' ``helpers.py`` are told apart."""
    name = frame.f_code.co_filename
    line = frame.f_lineno if lineno is None else lineno
    return f"cell line {line}" if is_cell(name) else f"{shown_path(name)} line {line}"


def user_frame(frame: Any) -> tuple[Any, int, str] | None:
    """The innermost user frame on the stack ending at ``frame``: ``(frame,
    line, label)``, or None when the stack holds no user code."""
    f = frame
    while f is not None:
        if not is_library(f.f_code.co_filename):
            return f, f.f_lineno, label(f)
        f = f.f_back
    return None


def cell_frame(frame: Any) -> tuple[Any, int] | None:
    """The outermost ``%%dp`` cell frame on the stack, with its line."""
    found = None
    f = frame
    while f is not None:
        if is_cell(f.f_code.co_filename):
            found = (f, f.f_lineno)
        f = f.f_back
    return found


def library_below(frame: Any, user: Any) -> str:
    """The outermost library module the user frame ``user`` called into, as a
    dotted-ish name (``torch.distributed.checkpoint``), or ""."""
    below = None
    f = frame
    while f is not None and f is not user:
        below = f
        f = f.f_back
    if below is None:
        return ""
    name = below.f_code.co_filename
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    for root in library_roots():
        if name.startswith(root):
            rel = name[len(root):].removesuffix(".py").replace(os.sep, ".")
            if root == own:
                rel = "dpnb." + rel
            return ".".join(rel.split(".")[:3])
    return os.path.basename(name)
