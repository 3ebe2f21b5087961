"""Collectives typed in ``%%dp`` cells are checked before they run; training's are not.

gloo aborts the whole engine process (SIGABRT) when two ranks join one
collective with different sizes, and hangs when their ops differ -- a typo
costs an engine and everything defined on it.  PyTorch's debug wrapper
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``) turns every such mismatch into a clear
error on all ranks, by exchanging each collective's fingerprint (op, shapes,
dtypes, devices) over a helper group first -- measured 4.3x slower on a small
all_reduce, too slow for training.

So each rank forms, next to the default group, one *checked* group (the same
ranks, created with the debug wrapper on), and while a ``%%dp`` cell runs it
is the default group: ``dist.all_reduce(t)`` in a cell is checked, while
``%dp train`` (which runs outside cells) and the user's wrapped model keep
the unchecked group.  While a cell runs, every torch.distributed collective
is also counted (op and its number in the cell) for ``%dp where``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch.distributed as dist

from .. import compat
from .sidedoor import COLLECTIVES

log = logging.getLogger("dpnb.engine.cellguard")


def form_checked_group(state) -> None:
    """Create this rank's checked group (collective: every rank at once)."""
    state.checked_group = compat.new_checked_group(state.backend, state.timeout_s)


def _counting(state, name: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        __tracebackhide__ = True  # IPython shows the user's cell line, not this frame
        calls = state.cell_calls
        calls[name] = calls.get(name, 0) + 1
        outer = state.current_collective
        state.current_collective = {"op": name, "seq": calls[name]}
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            # Raised again from here, without torch's frames: IPython formats
            # each frame with its source, and distributed_c10d.py is 5,000
            # lines -- with 8 released engines on 2 cores that formatting was
            # most of a 3 s report.  The message says all that matters.
            e.__traceback__ = None
            raise e from None
        finally:
            state.current_collective = outer

    counted.__dpnb_original__ = fn  # type: ignore[attr-defined]
    return counted


def _patch(state) -> None:
    import torch.distributed.distributed_c10d as c10d

    for mod in (dist, c10d):
        for name in COLLECTIVES:
            fn = getattr(mod, name, None)
            if fn is not None and not hasattr(fn, "__dpnb_original__"):
                setattr(mod, name, _counting(state, name, fn))


def _unpatch() -> None:
    import torch.distributed.distributed_c10d as c10d

    for mod in (dist, c10d):
        for name in COLLECTIVES:
            fn = getattr(mod, name, None)
            orig = getattr(fn, "__dpnb_original__", None)
            if orig is not None:
                setattr(mod, name, orig)


class CellGuard:
    """The pre/post-run-cell hooks of one engine (registered once per process)."""

    def __init__(self, state):
        self.state = state
        self.saved: Any = None

    def pre(self, *_info) -> None:
        st = self.state
        st.cell_calls = {}
        st.current_collective = None
        checked = st.checked_group
        if checked is None or not dist.is_initialized():
            return
        self.saved = compat.default_group()
        compat.set_default_group(checked)
        _patch(st)

    def post(self, *_result) -> None:
        _unpatch()
        if self.saved is not None:
            compat.set_default_group(self.saved)
            self.saved = None


def install(state) -> None:
    """Register the cell hooks on this engine's IPython (once) and point them at ``state``."""
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        return
    guard = getattr(state, "cell_guard", None)
    if guard is None:
        guard = CellGuard(state)
        ip.events.register("pre_run_cell", guard.pre)
        ip.events.register("post_run_cell", guard.post)
        state.cell_guard = guard
    guard.state = state
