"""The shell reply to one request of a kernel client, not merely the next one."""

from __future__ import annotations

import time


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
