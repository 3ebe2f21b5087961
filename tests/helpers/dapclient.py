"""JupyterLab's debugger, as the kernel sees it: DAP requests on the control
channel (``debug_request``), events on iopub (``debug_event``) -- what
@jupyterlab/debugger sends, without a browser."""

from __future__ import annotations

import itertools
import queue
import time


class Dap:
    def __init__(self, kc):
        self.kc = kc
        self.seq = itertools.count(1)
        self.events: list[dict] = []

    def request(self, command: str, timeout: float = 30.0, **arguments) -> dict:
        content = {"seq": next(self.seq), "type": "request", "command": command,
                   "arguments": arguments}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            r = self.kc.get_control_msg(timeout=max(0.1, deadline - time.monotonic()))
            if r["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return r["content"]

    def pump(self, sink: list | None = None, timeout: float = 0.2) -> None:
        """Read iopub for ``timeout``: debug events to ``self.events``, the rest to ``sink``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                m = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                return
            if m["msg_type"] == "debug_event":
                self.events.append(m["content"])
            elif sink is not None:
                sink.append(m)

    def wait_event(self, name: str, pred=lambda e: True, timeout: float = 60.0,
                   sink: list | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, e in enumerate(self.events):
                if e.get("event") == name and pred(e):
                    return self.events.pop(i)
            self.pump(sink, 0.2)
        raise AssertionError(f"no {name!r} debug event within {timeout} s; got "
                             f"{[e.get('event') for e in self.events]}")

    def start(self) -> None:
        """What JupyterLab sends when its debugger is switched on."""
        self.request("debugInfo")
        r = self.request("initialize", clientID="jupyterlab", clientName="JupyterLab",
                         adapterID="python", pathFormat="path", linesStartAt1=True,
                         columnsStartAt1=True, supportsVariableType=True,
                         supportsVariablePaging=True, supportsRunInTerminalRequest=True,
                         locale="en-us")
        assert r["success"], r
        r = self.request("attach")
        assert r["success"], r
