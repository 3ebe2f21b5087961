"""One rank's line of ``%dp status``: liveness and memory, no communication."""

from __future__ import annotations

import os
import resource
import socket

from dpnb.engine.proc.preload import wait_preload
from dpnb.engine.proc.shell import user_ns
from dpnb.engine.state import STATE_NAME


def status() -> dict:
    """Liveness and memory of this rank, for ``%dp status``."""
    wait_preload()

    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch
    import torch.distributed as dist

    ns = user_ns()
    st = ns.get(STATE_NAME)
    rss = _rss_bytes()
    out = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank": getattr(st, "rank", None),
        "backend": getattr(st, "backend", None),
        "device": str(getattr(st, "device", "")),
        "group": dist.is_initialized(),
        "generation": getattr(st, "generation", 0),
        "rss_bytes": rss,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
    }
    if st is not None:
        # lazy: torch-free at import (boot loads torch in a background thread)
        from dpnb.engine.device import is_accel, memory_allocated, memory_reserved

        if is_accel(st.device):  # reported as cuda_* whatever the accelerator
            out["cuda_allocated"] = memory_allocated(st.device)
            out["cuda_reserved"] = memory_reserved(st.device)
    return out


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
