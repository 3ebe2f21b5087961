"""A cell's reply carries what it published (dpnb.engine.cell.outcount), and the
notebook waits for exactly that much output (dpnb.cluster.transport): here on
a fake kernel and a fake AsyncResult; on real engines in
tests/cluster/test_spine_api.py."""

import sys
import threading
import types

from dpnb.cluster import transport
from dpnb.engine.cell import outcount


class FakeSession:
    def send(self, stream, msg_type, content=None, parent=None, **kw):
        return {"header": {"msg_type": msg_type}, "parent_header": parent["header"],
                "content": content}


class FakeKernel:
    def __init__(self):
        self.session = FakeSession()
        self.shell = types.SimpleNamespace(display_pub=types.SimpleNamespace(session=self.session),
                                           displayhook=types.SimpleNamespace(session=self.session))

    def init_metadata(self, parent):
        return {}

    def finish_metadata(self, parent, metadata, reply_content):
        return metadata


def _cell(kernel, msgs, status="ok", msg_id="m1"):
    """What ipykernel does for one execute_request: metadata, output, reply."""
    parent = {"header": {"msg_type": "execute_request", "msg_id": msg_id}}
    md = kernel.init_metadata(parent)
    for kind, content in msgs:
        kernel.session.send(None, kind, content, parent)
    reply = {"status": status}
    kernel.finish_metadata(parent, md, reply)
    return reply


def _kernel(monkeypatch):
    k = FakeKernel()
    for name in ("stdout", "stderr"):  # pytest's capture streams carry no session
        monkeypatch.setattr(sys, name, types.SimpleNamespace(session=k.session))
    assert outcount.install(k)
    return k


def test_reply_counts_what_the_cell_published(monkeypatch):
    k = _kernel(monkeypatch)
    reply = _cell(k, [("status", {"execution_state": "busy"}), ("execute_input", {"code": "x"}),
                      ("stream", {"name": "stdout", "text": "hello\n"}),
                      ("stream", {"name": "stdout", "text": "0123"}),
                      ("stream", {"name": "stderr", "text": "warn\n"}),
                      ("display_data", {"data": {}}), ("execute_result", {"data": {}})])
    assert reply[outcount.KEY] == {"stdout": 10, "stderr": 5, "displays": 1, "result": True}
    assert _cell(k, [], msg_id="m2")[outcount.KEY] == outcount.zero()  # `pass`: nothing to wait for


def test_what_cannot_be_counted_leaves_the_reply_without_counts(monkeypatch):
    k = _kernel(monkeypatch)
    assert outcount.KEY not in _cell(k, [("stream", {"name": "stdout", "text": "50%\r"})])
    assert outcount.KEY not in _cell(k, [("comm_msg", {})], msg_id="m2")
    assert outcount.KEY not in _cell(k, [("error", {})], status="error", msg_id="m3")


class FakeAR:
    """A finished single-engine AsyncResult whose output is still on its way."""

    def __init__(self, promised):
        self._metadata = [{"stdout": "", "stderr": "", "outputs": [], "execute_result": None}]
        self._output_event = threading.Event()
        content = {"status": "ok", "execution_count": 1}
        if promised is not None:
            content[outcount.KEY] = promised
        self._raw_results = [types.SimpleNamespace(_content=content)]

    def wait_for_output(self, timeout):
        return self._output_event.wait(timeout)


def test_the_notebook_waits_until_the_promised_output_is_in():
    ar = FakeAR({"stdout": 6, "stderr": 0, "displays": 1, "result": True})
    md = ar._metadata[0]
    assert not transport.wait_for_output(ar, 0.05)  # nothing in yet, no idle
    md["stdout"] = "hello\n"
    md["execute_result"] = {"data": {}}
    assert not transport.wait_for_output(ar, 0.05)  # the display is still missing
    md["outputs"].append({"data": {}})
    assert transport.wait_for_output(ar, 0.05)


def test_no_output_promised_means_no_wait_and_no_counts_means_idle():
    assert transport.wait_for_output(FakeAR(outcount.zero()), 0.05)
    ar = FakeAR(None)
    assert not transport.wait_for_output(ar, 0.05)  # no counts: waits for idle
    ar._output_event.set()
    assert transport.wait_for_output(ar, 0.05)
