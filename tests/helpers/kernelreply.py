"""Kernel clients for tests: one reached through its connection file, and the
shell reply to one request, not merely the next one."""

from __future__ import annotations

import time

#: How long a heartbeat ping may go unanswered before a client built from a
#: connection file calls its kernel dead. jupyter_client's default is 1 s, and
#: ``wait_for_ready`` then raises "Kernel died before replying to kernel_info" at
#: once, for a live kernel paused a second (tests/unit/test_kernel_client_helper.py).
#: CI failed with that message in the Hub test, its two cores loaded by the other
#: worker's clusters (whether that kernel was live is not known). A kernel that
#: really dies still fails within this.
HEARTBEAT_S = 10.0


def connected(connection_file, ready_s: float = 60.0):
    """A started ``BlockingKernelClient`` on the kernel of ``connection_file``, its
    kernel answering ``kernel_info`` (the way a second client, not the kernel's
    manager, reaches a kernel: it can only judge liveness by heartbeats)."""
    from jupyter_client import BlockingKernelClient

    kc = BlockingKernelClient(connection_file=str(connection_file))
    kc.load_connection_file()
    kc.hb_channel.time_to_dead = HEARTBEAT_S
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=ready_s)
    except BaseException:
        kc.stop_channels()
        raise
    return kc


def reply_to(kc, msg_id: str, timeout: float = 10.0) -> dict:
    """The shell reply (the whole message) whose parent is request ``msg_id``.

    Others are skipped: jupyter_client's ``wait_for_ready`` sends
    ``kernel_info`` again every second until the kernel answers and leaves the
    extra replies queued, so on a loaded machine the next reply read is not
    always this request's (seen: a cell's error read as the next cell's; an
    interrupted cell's reply read as the cell's before it, "ok")."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
