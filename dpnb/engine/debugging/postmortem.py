"""Post-mortem of the last failed cell on this rank: its frames and their locals.

IPython keeps the last exception (``sys.last_traceback``) when a cell raises;
this walks it from the user's cell frame down and describes each frame's
locals without sending any object: tensors as shape / dtype / device, other
values as a shortened repr.  No engine ever waits on stdin (pdb would).
Local, no communication.
"""

from __future__ import annotations

import reprlib
import sys
import traceback
import types

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = 6
_repr.maxdict = 6

_SKIP = (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType)


def describe(value) -> str:
    """One short line for a local variable."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None and hasattr(value, "device"):
        return f"{type(value).__name__} shape={list(shape)} dtype={dtype} device={value.device}"
    return _repr.repr(value)


def _is_user(filename: str) -> bool:
    return filename.startswith("<ipython-input") or ("ipykernel_" in filename
                                                     and filename.endswith(".py"))


def post_mortem(ns: dict, max_frames: int = 12, max_locals: int = 25) -> str:
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return "no failed cell on this rank"
    frames = traceback.walk_tb(tb)
    rows = list(frames)
    start = next((i for i, (f, _) in enumerate(rows) if _is_user(f.f_code.co_filename)), 0)
    out = [f"{type(sys.last_value).__name__}: {sys.last_value}"]
    for f, lineno in rows[start:start + max_frames]:
        code = f.f_code
        where = "cell" if _is_user(code.co_filename) else code.co_filename.rsplit("/", 2)[-1]
        out.append(f"-- {where}, line {lineno}, in {code.co_name}")
        shown = 0
        for name, value in f.f_locals.items():
            if name.startswith("_") or isinstance(value, _SKIP) or name in ("In", "Out"):
                continue
            if where == "cell" and name in ("torch", "dist", "rank", "world_size", "device",
                                            "local_rank", "get_ipython", "exit", "quit"):
                continue
            out.append(f"     {name} = {describe(value)}")
            shown += 1
            if shown >= max_locals:
                out.append("     ...")
                break
    return "\n".join(out)
