"""How a user's file is named in reports: a path the user can open.

A report that says ``helpers.py line 4`` is ambiguous once two scripts have a
``helpers.py`` each (``%dp run a/main.py``, then ``b/main.py``); the full
path is not, and a path relative to the folder the notebook runs in is
shorter where the file is below it.  Pure: no torch, no IPython.
"""

from __future__ import annotations

import os


def shown_path(filename: str, base: str | None = None) -> str:
    """``filename`` relative to ``base`` (default: the current folder) when the
    file lies below it -- shorter and unambiguous -- else the absolute path.
    Names that are not paths (``<string>``) are returned as they are."""
    if not filename or filename.startswith("<"):
        return filename
    full = os.path.abspath(filename)
    try:
        rel = os.path.relpath(full, base if base is not None else os.getcwd())
    except ValueError:  # another drive (Windows): no relative path exists
        return full
    return rel if not rel.startswith(os.pardir) and len(rel) < len(full) else full
