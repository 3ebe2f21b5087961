"""JupyterLab's debugger in a notebook with a dpnb cluster: the kernel's side.

``%load_ext dpnb`` puts a :class:`dpnb.session.dap.DapRouter` in front of the
kernel's own debug handler (ipykernel's ``do_debug_request``, debugpy
behind it): JupyterLab's requests about ranks are answered from the ranks,
the rest as before.  A ``%%dp`` cell run while the debugger is attached is
named as JupyterLab named it -- ipykernel's file for the cell's whole text,
``%%dp`` line included (:func:`ipykernel.compiler.get_file_name`) -- and its
ranks are told that name, the shift of their copy (the lines down to
``%%dp``) and the breakpoints.  Outside a kernel (a terminal IPython) there
is no debugger to route and nothing is installed.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

from ..core.cellflags import dap_flag
from ..ranks import parse_ranks
from ..session.dap import DapRouter

log = logging.getLogger(__name__)


def install(shell, cluster) -> DapRouter | None:
    """The router in front of this kernel's debugger, or None without one."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not hasattr(kernel, "do_debug_request") \
            or not hasattr(kernel, "_publish_debug_event"):
        return None
    router = DapRouter(kernel.do_debug_request, kernel._publish_debug_event, cluster)
    kernel.do_debug_request = router.handle
    return router


def _this_cell(shell) -> str | None:
    """The text of the cell the kernel is running, as the notebook sent it."""
    kernel = getattr(shell, "kernel", None)
    try:
        return kernel.get_parent("shell")["content"]["code"]
    except (AttributeError, KeyError, TypeError) as e:
        log.debug("no running cell's text from the kernel: %s", e)
        return None


def cell_flag(router: DapRouter | None, shell) -> str | None:
    """The ``--dap`` flag for the ``%%dp`` cell now running, or None (debugger off)."""
    if router is None or not router.on:
        return None
    code = _this_cell(shell)
    if not code:
        return None
    # lazy: ipykernel is there whenever a router is (it was installed on a kernel)
    from ipykernel.compiler import get_file_name

    lines = code.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.startswith("%%dp")), None)
    if head is None:  # not a %%dp cell (dpnb.run from a plain cell): nothing to map
        return None
    cell = router.cell(get_file_name(code), head + 1)
    return dap_flag(cell) if cell is not None else None


def debugged(router: DapRouter | None, c, ranks, flag: str | None):
    """Context for running the cell: its ranks' stops reach JupyterLab while it runs."""
    if router is None or flag is None:
        return nullcontext()
    sel = parse_ranks(ranks, c.world_size)
    router.arm(c, sel)
    return router.running(c, sel)
