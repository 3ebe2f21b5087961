"""``%dp run SCRIPT [ARGS...]``: a torchrun script, run on every rank as torchrun would.

The notebook reads the script and sends its source with the cell, so a host
without the file (no shared filesystem) runs the same code; tracebacks and
``%dp where`` still show its lines (they are put in ``linecache``).  On each
rank, for the run:

* ``__name__ == "__main__"``, ``__file__`` the script's path, ``sys.argv``
  ``[path, *ARGS]`` (argparse names the script), the script's folder first on
  ``sys.path``, ``sys.modules["__main__"]`` the script's module (pickles of
  classes it defines name ``__main__``, as under torchrun);
* the torchrun variables are already in the environment (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ...; set by :func:`setup.init_rank`), and
  its ``init_process_group`` / ``destroy_process_group`` are made safe by
  :mod:`dpnb.engine.lifecycle`;
* ``sys.exit(0)`` or ``sys.exit()`` is a normal end; any other status is the
  run's error on that rank.

Afterwards the script's module globals are copied into the rank's namespace,
as IPython's ``%run`` does (names the script set inside ``main()`` are gone
with its frame; ``%dp debug`` reaches them after a failure).  No
communication of its own: the script's collectives are its own.
"""

from __future__ import annotations

import linecache
import os
import sys
import types

#: names of the rank's namespace a script's globals never replace
KEEP = frozenset({"_dpnb", "get_ipython", "exit", "quit", "In", "Out", "_ih", "_oh", "_dh"})


class ScriptExit(Exception):
    """The script ended with ``sys.exit(status)``, status not 0."""


def run(ns: dict, path: str, argv: list[str], source: str) -> None:
    """Run ``source`` (the script at ``path``) with ``argv`` on this rank."""
    __tracebackhide__ = True  # the report starts at the script's own frames
    code = compile(source, path, "exec")
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    mod = types.ModuleType("__main__")
    g = mod.__dict__
    g.update(__file__=path, __cached__=None, __builtins__=__builtins__,
             exit=sys.exit, quit=sys.exit)  # as python's own exit(): SystemExit(status)
    folder = os.path.dirname(path)
    saved_argv, saved_main = sys.argv, sys.modules.get("__main__")
    sys.argv = [path, *argv]
    sys.modules["__main__"] = mod
    sys.path.insert(0, folder)
    try:
        exec(code, g)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise ScriptExit(f"{os.path.basename(path)} exited with status {e.code}") from None
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        ns.update({k: v for k, v in g.items() if not k.startswith("__") and k not in KEEP})


def cell(path: str, argv: list[str], source: str) -> str:
    """The one-line cell that runs the script on a rank (notebook side calls this)."""
    return (f"__import__('dpnb.engine.script', fromlist=['run']).run(get_ipython().user_ns, "
            f"{path!r}, {list(argv)!r}, {source!r})")
