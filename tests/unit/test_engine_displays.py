"""Displays from the ranks that redraw themselves, as the notebook shows them.

An engine's ``handle.update(...)`` reaches the notebook as a display marked
``DISPLAY_UPDATE`` (``dpnb.engine.proc.process.forward_display_updates``); the
real round trip through a kernel is ``tests/cluster/test_kernel.py::
test_a_display_updated_through_its_handle_updates_live``.  Here: the pure
folding of a rank's display list, and the streamer's live handles, with
fakes for ipyparallel's results and IPython's display.
"""

import IPython.display

from dpnb.cluster import render
from dpnb.engine.proc.process import DISPLAY_UPDATE


def _html(text, did=None, update=False):
    t = {} if did is None else {"display_id": did}
    if update:
        t[DISPLAY_UPDATE] = True
    return {"data": {"text/html": text, "text/plain": "<HTML>"}, "metadata": {}, "transient": t}


def test_an_update_replaces_its_display_in_place_and_is_not_shown_itself():
    outs = [_html("[2/5 :", "t"), _html("figure"), _html("[3/5", "t", True),
            _html("[5/5 done]", "t", True), _html("other", "u", True)]
    folded = render.fold_updates(outs)
    assert [c["data"]["text/html"] for c in folded] == ["[5/5 done]", "figure", "other"]
    assert render.live_key(folded[0]) == ("display", "t") and render.live_key(folded[1]) is None


class _AR:
    def __init__(self, outputs):
        self._metadata = [{"stdout": "", "stderr": "", "outputs": outputs}]


def test_the_streamer_shows_a_redrawn_display_live_and_applies_the_latest_update(monkeypatch):
    calls = []

    class Handle:
        def __init__(self, data):
            self.data = data

        def update(self, data, metadata=None, raw=False):
            calls.append(("update", data["text/html"]))

    def fake_display(data, metadata=None, raw=False, display_id=False):
        calls.append(("display", data["text/html"]))
        return Handle(data)

    monkeypatch.setattr(IPython.display, "display", fake_display)
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data, *a, **k: None)
    outs = [_html("[1/5", "t"), _html("plain")]
    s = render.Streamer({0: _AR(outs)}, delay_s=0, min_interval_s=0)
    s._kernel = True
    s.poll()
    outs += [_html("[2/5", "t", True), _html("[3/5", "t", True)]
    s.poll()
    s.poll()  # nothing new: nothing redrawn
    outs.append(_html("[5/5 done]", "t", True))
    s.close()
    # the plain display waits for the end (grouped with the other ranks'); the
    # table is shown once and redrawn with the latest drawing of each poll
    assert calls == [("display", "[1/5"), ("update", "[3/5"), ("update", "[5/5 done]")]
    assert s.shown_live == {(0, ("display", "t"))}
