"""Knocking on the engines' side doors (see :mod:`dpnb.engine.sidedoor`).

One connection to each rank's door -- a UNIX socket path for local clusters,
``(address, port)`` across hosts -- the handshake of :mod:`dpnb.engine.proc.wire`
(proving the cluster's token without sending it), then one JSON request and
one answer.  All ranks are asked in parallel and each answer is awaited for
at most ``timeout`` seconds.  This channel works while an engine's main
thread is blocked in a collective, when ipyparallel's does not.
"""

from __future__ import annotations

import json
import logging
import threading

from dpnb.engine.proc import wire

log = logging.getLogger(__name__)

#: an answer (``where`` with a long cell line) stays far below this
MAX_ANSWER = 16 << 20


def knock(addr: str, port: int, token: str, cmd: str, timeout: float = 2.0,
          **extra) -> dict | None:
    """One command to one door; its answer, or None if the door did not answer."""
    try:
        with wire.connect(addr, port, timeout) as s:
            wire.client_handshake(s, token)
            wire.send_frame(s, json.dumps({"cmd": cmd, **extra}).encode())
            return json.loads(wire.recv_frame(s, MAX_ANSWER))
    except (OSError, ValueError) as e:
        log.info("side door %s:%s (%s) did not answer: %s", addr, port, cmd, e)
        return None


def is_closed(addr: str, port: int, timeout: float = 1.0) -> bool:
    """True when nothing listens at the door any more: its engine process is gone.

    Faster than the controller's heartbeat (which allows 30 missed beats)
    for engines whose launcher reports no exits (slurm, mpi).
    """
    try:
        wire.connect(addr, port, timeout).close()
        return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError as e:  # unreachable or slow: not proof of death
        log.info("side door %s:%s not checked: %s", addr, port, e)
        return False


def knock_all(doors: dict[int, tuple[str, int]], ranks, token: str, cmd: str,
              timeout: float = 2.0, **extra) -> dict[int, dict | None]:
    """``cmd`` (with ``extra``) to the doors of ``ranks`` at once: ``{rank: answer or None}``."""
    out: dict[int, dict | None] = {}
    threads = []
    for r in ranks:
        if r not in doors:
            out[r] = None
            continue
        addr, port = doors[r]

        def ask(r=r, addr=addr, port=port):
            out[r] = knock(addr, port, token, cmd, timeout, **extra)

        t = threading.Thread(target=ask, name=f"dpnb-knock-{r}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout + 0.5)
    return out
