"""``%dp run SCRIPT [ARGS...]``, the notebook's side: read the script, send it as a cell.

The script's source travels with the cell (:func:`dpnb.engine.cell.script.cell`),
so every rank runs the notebook's copy whether or not its host sees the file
(the modules beside it are imported from each engine's own filesystem); the
run is an ordinary cell in every other way -- streaming output,
``--timeout``, Ctrl-C, ``%dp where``, the fault report, ``%dp debug`` and
pdb on the ranks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dpnb.engine.cell.script import cell
from ..errors import DpnbError

if TYPE_CHECKING:
    from . import Engines as Cluster
    from .types import CellResult

#: a script larger than this is refused (it travels inside one cell message)
MAX_SCRIPT_BYTES = 8 << 20


def run_script(c: "Cluster", path: str, args=(), *, ranks=None, timeout: float | None = None,
               unchecked: bool = False, display: bool = True,
               raise_errors: bool = True) -> "CellResult":
    """Run the Python script at ``path`` on the selected ranks (all by default)
    with ``args`` as its command line."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full):
        raise DpnbError(f"no script at {path!r} (looked in {os.getcwd()}): give the path of a "
                        f".py file, e.g. %dp run train.py --epochs 1")
    size = os.path.getsize(full)
    if size > MAX_SCRIPT_BYTES:
        raise DpnbError(f"{path} is {size / 2**20:.1f} MiB; %dp run sends a script with the "
                        f"cell and takes up to {MAX_SCRIPT_BYTES >> 20} MiB")
    try:
        with open(full, encoding="utf-8") as f:
            source = f.read()
        compile(source, full, "exec")
    except (UnicodeDecodeError, SyntaxError) as e:
        raise DpnbError(f"{path} is not a Python script dpnb can run: {e}") from None
    return c.run(cell(full, [str(a) for a in args], source), ranks=ranks, timeout=timeout,
                 stream=display, display=display, raise_errors=raise_errors,
                 unchecked=unchecked)
