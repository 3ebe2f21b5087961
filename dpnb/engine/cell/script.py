"""``%dp run SCRIPT [ARGS...]``: a torchrun script, run on every rank as torchrun would.

The notebook reads the script and sends its source with the cell, so a host
without the file (no shared filesystem) runs the same code; tracebacks and
``%dp where`` still show its lines (they are put in ``linecache``).  On each
rank, for the run:

* ``__name__ == "__main__"``, ``__file__`` the script's path, ``sys.argv``
  ``[path, *ARGS]`` (argparse names the script), the script's folder first on
  ``sys.path``, ``sys.modules["__main__"]`` the script's module (pickles of
  classes it defines name ``__main__``, as under torchrun);
* its own module world, as torchrun's fresh process gives it: modules from
  the script's folder (its siblings, ``helpers.py``, ``models/``) are
  imported afresh for this run and forgotten after it, so a second script
  with its own ``helpers.py`` gets its own, and the same script run again
  re-reads its edited siblings.  Siblings are read from the engine's
  filesystem (only the script itself travels with the cell).  Every other
  module -- torch, numpy, the user's installed packages -- stays shared and
  is never imported twice.  ``sys.modules``, ``sys.path``, ``sys.argv`` and
  ``__main__`` are the rank's own again afterwards;
* the torchrun variables are already in the environment (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ...; set by :func:`setup.init_rank`), and
  its ``init_process_group`` / ``destroy_process_group`` are made safe by
  :mod:`dpnb.engine.group.lifecycle`;
* ``sys.exit(0)`` or ``sys.exit()`` is a normal end; any other status is the
  run's error on that rank.

A failure is reported from the script's own frames (its path and line
first, as ``python train.py`` prints it), not from the one-line cell that
carries the script's text.

Afterwards the script's module globals are copied into the rank's namespace,
as IPython's ``%run`` does (names the script set inside ``main()`` are gone
with its frame; ``%dp debug`` reaches them after a failure).  No
communication of its own: the script's collectives are its own.
"""

from __future__ import annotations

import linecache
import logging
import os
import sys
import types

from dpnb.engine.debugging import frames

log = logging.getLogger(__name__)

#: names of the rank's namespace a script's globals never replace
KEEP = frozenset({"_dpnb", "get_ipython", "exit", "quit", "In", "Out", "_ih", "_oh", "_dh"})


class ScriptExit(Exception):
    """The script ended with ``sys.exit(status)``, status not 0."""


def _siblings(folder: str) -> set[str]:
    """Top-level module names the script's folder provides (``helpers.py``,
    ``models/``, ``ext.cpython-311-x86_64-linux-gnu.so``)."""
    try:
        names = os.listdir(folder)
    except OSError:  # expected: a host without the script's folder has no siblings to import
        return set()
    out = set()
    for n in names:
        if n.endswith(".py"):
            out.add(n[:-3])
        elif n.endswith((".so", ".pyd")):
            out.add(n.split(".", 1)[0])
        elif "." not in n and os.path.isdir(os.path.join(folder, n)):
            out.add(n)  # a package, or a namespace package
    return out


def _files(m) -> list[str]:
    d = getattr(m, "__dict__", None) or {}  # never getattr: a lazy module would import
    f = d.get("__file__")
    if f:
        return [f]
    return [p for p in (d.get("__path__") or ()) if isinstance(p, str)]


def _owned(m, folder: str) -> bool:
    """A module loaded from the script's folder, not a library (torch, site-packages,
    dpnb) that happens to live below it."""
    fs = _files(m)
    return bool(fs) and all(f.startswith(folder) and not frames.is_library(f) for f in fs)


class _World:
    """The rank's imports, set aside for one script's run and given back after it."""

    def __init__(self, folder: str):
        self.folder = os.path.join(folder, "")
        self.path, self.argv, self.main = list(sys.path), sys.argv, sys.modules.get("__main__")
        self.before = dict(sys.modules)
        sib = _siblings(folder)
        # a same-named module already loaded (another script's sibling, a cell's
        # import) would shadow the script's own: under torchrun it does not exist
        self.hidden = {k: m for k, m in self.before.items()
                       if k.split(".", 1)[0] in sib and m is not None and _files(m)
                       and not any(frames.is_library(f) for f in _files(m))}
        for k in self.hidden:
            del sys.modules[k]

    def restore(self) -> None:
        mods = sys.modules
        for k, m in list(mods.items()):
            if self.before.get(k) is not m and _owned(m, self.folder):
                del mods[k]
        mods.update(self.hidden)
        if self.main is not None:
            mods["__main__"] = self.main
        sys.path[:] = self.path
        sys.argv = self.argv


def _script_traceback(e: BaseException, tb) -> None:
    """Have IPython report ``e`` from the script's frames on (``tb``): not from
    the cell -- one line holding the whole script as a literal -- nor from
    :func:`run`.  ``%dp debug`` starts there too."""
    if tb is None or hasattr(type(e), "_render_traceback_"):
        return

    def render():
        # lazy: boot imports the engine modules before the kernel (and IPython) exists
        from IPython import get_ipython

        sys.last_traceback = tb  # IPython set the cell's; pdb post mortem starts at the script
        return get_ipython().InteractiveTB.structured_traceback(type(e), e, tb, tb_offset=0)

    try:
        e._render_traceback_ = render  # read by IPython's showtraceback for this exception only
    except AttributeError as why:  # an exception type with __slots__: the cell's frame stays
        log.debug("script traceback kept whole: %r", why)


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
    world = _World(folder)
    sys.argv = [path, *argv]
    sys.modules["__main__"] = mod
    sys.path.insert(0, folder)
    try:
        exec(code, g)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise ScriptExit(f"{os.path.basename(path)} exited with status {e.code}") from None
    except BaseException as e:
        _script_traceback(e, e.__traceback__.tb_next)  # past this frame: the script's
        raise
    finally:
        world.restore()
        ns.update({k: v for k, v in g.items() if not k.startswith("__") and k not in KEEP})


def cell(path: str, argv: list[str], source: str) -> str:
    """The one-line cell that runs the script on a rank (notebook side calls this)."""
    return (f"__import__('dpnb.engine.cell.script', fromlist=['run']).run(get_ipython().user_ns, "
            f"{path!r}, {list(argv)!r}, {source!r})")
