"""The engine process's entry point for clusters dpnb starts on this host.

``python -m dpnb.engine.boot [ipengine arguments]`` does what ``python -m
ipyparallel.engine`` does, but does not sit idle first.  ipyparallel starts
engines only once the controller has written its connection file, and an
engine imports torch only when the first cell asks for it, so start-up
would be controller, then engine imports, then registration, then torch,
one after another.  Here the engine is launched together with the
controller; it starts importing torch (and what the first ``%dp wrap``
needs: DDP, FSDP, torch._dynamo -- another ~3 s of CPU) in a background
thread at once, imports ipyparallel meanwhile, then waits for the
connection file that
``DPNB_CONNECTION_FILE`` names and hands it to ipyparallel as
``IPP_CONNECTION_INFO``.  The process and its PID are the engine's own.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from dpnb.engine.proc.preload import import_quietly, preload_modules


def _preload() -> None:
    import_quietly(("torch", "torch.distributed", *preload_modules()))


def wait_for_connection(path: str, timeout: float, poll: float = 0.02) -> str | None:
    """The connection file's text once it exists and parses (the controller
    may be caught half-way through writing it), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                text = f.read()
            json.loads(text)
            return text
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(poll)


def _watch_parent(period: float = 0.5) -> None:
    """Exit when the process that started this engine is gone.

    Set by :mod:`dpnb.engine.hostagent` (``DPNB_WATCH_PARENT``): an agent
    that is SIGKILLed cannot stop its engines, so they stop themselves.
    """
    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        os._exit(3)

    threading.Thread(target=loop, name="dpnb-agent-watch", daemon=True).start()


def main() -> None:
    if os.environ.pop("DPNB_WATCH_PARENT", ""):
        _watch_parent()
    threading.Thread(target=_preload, name="dpnb-preload-torch", daemon=True).start()
    # lazy: torch's import thread starts before ipyparallel's engine loads
    from ipyparallel.engine.app import main as engine_main

    path = os.environ.pop("DPNB_CONNECTION_FILE", "")
    wait = float(os.environ.pop("DPNB_CONNECTION_WAIT", "120"))
    if path and not os.environ.get("IPP_CONNECTION_INFO"):
        text = wait_for_connection(path, wait)
        if text is not None:
            os.environ["IPP_CONNECTION_INFO"] = text
        # else: ipyparallel looks for the file itself and says it never came
    # ipyparallel's engine would bind an unauthenticated ZMQ socket on
    # 127.0.0.1 to watch the controller's heartbeat, and run a Python callback
    # in the engine's main loop for every message any local user sends to it:
    # a stranger streaming bytes there starved the main thread (a re-formation
    # took 6.6 s instead of 0.04 s).  dpnb watches its engines' lives itself
    # (the reaper, the host agents, the side doors), so that listener is off.
    sys.argv.append("--IPEngine.max_heartbeat_misses=0")
    engine_main()


if __name__ == "__main__":
    main()
