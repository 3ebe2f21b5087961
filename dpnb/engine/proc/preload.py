"""Importing what the first ``%dp wrap`` needs while the CPU would idle.

No communication: each engine imports on its own, in a background thread
whose name every entry point waits on (two threads importing one module at
once can see it half initialised).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


# Imported on the first %dp wrap: about 3 s of CPU per engine (DDP pulls in
# torch._dynamo, FSDP pulls in DTensor).  Engines started through
# dpnb.engine.boot import them while the cluster starts (the CPU is mostly
# waiting then); other engines import them in the background once the group
# is up, so the first wrap does not pay for them.
PRELOAD_MODULES = ("torch.nn.parallel", "torch.distributed.optim", "torch.distributed.fsdp",
            "torch._dynamo", "dpnb.engine.train.training")


#: ``DPNB_PRELOAD=torch`` (set by the local launcher when the engines
#: outnumber the cores): import torch only.  The preload is free while the
#: CPU waits for the cluster to start; with 16 engines on 2 cores it is not --
#: it made the start 1.4x raw ipyparallel's at N=16 and 1.7x at N=32 -- and
#: only the first %dp wrap needs those modules.
PRELOAD_ENV = "DPNB_PRELOAD"


def preload_modules() -> tuple[str, ...]:
    return () if os.environ.get(PRELOAD_ENV) == "torch" else PRELOAD_MODULES


def import_quietly(names, report=None) -> None:
    """Import ``names`` in order.  A failure goes to ``report(name, exc)`` (default: the
    log), never raised: the real import, in the cell or call that needs it, reports it."""

    report = report or (lambda n, e: log.info("preload of %s failed: %s: %s", n, type(e).__name__, e))
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # reported again, loudly, by the import that needs it
            report(name, e)


PRELOAD_THREAD = "dpnb-preload"  # every preload thread's name starts with this


def _preloading() -> list:
    return [t for t in threading.enumerate()
            if t.name.startswith(PRELOAD_THREAD) and t.is_alive()]


def wait_preload(*_ignored) -> None:
    """Block until this engine's background imports are done.

    Two threads importing the same modules at once can hand one of them a
    partly initialised module (Python's answer to concurrent circular imports),
    so every dpnb entry point on the engine -- and every cell, through a
    ``pre_run_cell`` hook -- waits for them first: the threads, by name, of
    :mod:`dpnb.engine.boot` and of :func:`start_preload`.
    """
    me = threading.current_thread()
    for t in _preloading():
        if t is not me:
            t.join()


def start_preload() -> None:
    """Import what the first ``%dp wrap`` needs in the background, once per process."""
    if _preloading() or all(m in sys.modules for m in preload_modules()):
        return
    threading.Thread(target=import_quietly, args=(preload_modules(),), name=PRELOAD_THREAD,
                     daemon=True).start()
    # lazy: boot imports this module before the kernel (and IPython) exists
    from IPython import get_ipython

    ip = get_ipython()
    if ip is not None and wait_preload not in ip.events.callbacks.get("pre_run_cell", []):
        ip.events.register("pre_run_cell", wait_preload)
