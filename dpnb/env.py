"""Where is this code running?  IPython, a Jupyter kernel, or a plain terminal.

A leaf module (imports nothing from dpnb) so that every layer -- output
rendering, progress bars, views -- asks the same question the same way.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("dpnb")

#: Held while dpnb renders a matplotlib figure.  Agg shares its font cache
#: across all figures of the process and no longer locks it while drawing, and
#: dpnb draws from two threads at once (the training progress curve on the
#: main thread, the dashboard's poller in the background): a process-wide
#: resource, so a process-wide lock.
RENDER_LOCK = threading.RLock()


def ipython():
    """The running IPython shell, or None outside IPython."""
    try:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from IPython import get_ipython
    except ImportError:  # IPython is a dependency; a stripped environment may lack it
        log.debug("IPython is not importable: treating this as a plain terminal")
        return None
    return get_ipython()


def in_kernel() -> bool:
    """True inside a Jupyter kernel (widgets and rich display work there)."""
    ip = ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None
