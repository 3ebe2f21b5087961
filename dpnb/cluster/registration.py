"""Waiting for a new cluster's engines to register, without trusting one notification.

How the client learns of engines: when it connects, the controller's hub
answers its ``connection_request`` with the engines registered so far; every
engine after that reaches it only as a ``registration_notification`` on a
PUB/SUB socket that ipyparallel's ``Client`` connects *after* that answer.
ZeroMQ's subscriber joins asynchronously, so an engine that finishes
registering between the answer and the subscription is never announced: the
hub has it, the client never will.  Engines forked from a warm zygote
register within a fraction of a second of the start -- inside that window on
a loaded machine -- and such a start waited its whole timeout with every
engine up (CI, 2026-11-28: "only 0 of 2 engines registered within 120 s",
both engines alive).

So the wait asks the hub itself (``queue_status``, answered on the query
socket, not the subscription) every :data:`ASK_HUB_S`: when the hub counts
more engines than the client does, notifications were lost, and a fresh
client -- whose connection answer lists every engine -- replaces it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dpnb.errors import StartError

log = logging.getLogger(__name__)

ASK_HUB_S = 1.0  # a lost notification costs at most this long, not the start timeout


def hub_engines(client) -> set[int]:
    """The engine ids the controller's hub has registered (asked on the query socket)."""
    try:
        status = client.queue_status()
    except Exception as e:  # the hub answers an error while it has no engine at all
        log.debug("the hub's engine list (none yet?): %s: %s", type(e).__name__, e)
        return set()
    return {k for k in status if isinstance(k, int)}


def wait_registered(icluster, client, n: int, timeout: float,
                    failures: Callable[[], list[str]] = lambda: [],
                    unreachable: str = "") -> object:
    """Wait until ``client`` has ``n`` engines; the client to use from then on.

    ``failures()`` lists engines that ended before registering (their
    launcher's words): the wait ends at once with them.  A hub that has more
    engines than the client replaces the client (see the module's docstring).
    ``unreachable`` ends the timeout's message: what the user can change.
    """
    deadline = time.monotonic() + timeout
    ask = time.monotonic() + ASK_HUB_S
    while len(client.ids) < n:
        bad = failures()
        if bad:
            raise StartError(f"{len(client.ids)} of {n} engines registered; then:\n"
                             + "\n".join(bad))
        now = time.monotonic()
        if now > deadline:
            raise StartError(f"only {len(client.ids)} of {n} engines registered within "
                             f"{timeout:.0f} s{unreachable}")
        if now >= ask:
            ask = now + ASK_HUB_S
            client = _caught_up(icluster, client)
        time.sleep(0.05)
    return client


def _caught_up(icluster, client):
    """``client``, or a fresh one when the hub has engines ``client`` was never told of."""
    hub = hub_engines(client)
    if len(hub) <= len(client.ids):
        return client
    log.warning("the client missed %d engine registration(s) (hub: %s, client: %s): "
                "connecting a fresh client", len(hub) - len(client.ids), sorted(hub),
                sorted(client.ids))
    fresh = icluster.connect_client_sync()
    client.close()
    return fresh
