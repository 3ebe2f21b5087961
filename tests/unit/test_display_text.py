"""Every view dpnb shows in a kernel carries a real ``text/plain`` form.

A notebook run headless (nbconvert, papermill) keeps each display's
``text/plain``; ipywidgets' own is the widget's repr (``HTML(value="<table
class='dpnb-status'>...``).  Here the display data that ``%dp status``, the
training progress and a quiz question publish is captured and its text read.
"""

import IPython.display
import pytest

from dpnb.core.events import ProgressEvent, TrainSummary

from dpnb import display as D
from dpnb import progress, quiz

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

ROWS = [{"rank": r, "host": "node-a", "pid": 100 + r, "device": "cpu", "backend": "gloo",
         "alive": r != 1, "state": "idle", "rss_bytes": 3 * 2**20} for r in range(2)]


class _Handle:
    def __init__(self, shown):
        self.shown = shown

    def update(self, data, raw=False):
        self.shown.append(("update", data))


@pytest.fixture
def shown(monkeypatch):
    """What was displayed, as (kind, data) in order; every module thinks it runs in a kernel."""
    out = []

    def fake_display(obj, raw=False, display_id=False):
        assert raw, "a view is displayed as its bundle (raw=True), not as the widget object"
        out.append(("display", obj))
        return _Handle(out) if display_id else None

    monkeypatch.setattr(IPython.display, "display", fake_display)
    for mod in (D, progress, quiz):
        monkeypatch.setattr(mod, "in_kernel", lambda: True)
    return out


def test_status_in_a_kernel_keeps_the_table_as_its_text(shown):
    D.show_status(ROWS)
    ((kind, data),) = shown
    assert WIDGET_VIEW in data  # still the widget in Jupyter
    text = data["text/plain"]
    assert "HTML(" not in text and "<table" not in text
    lines = text.splitlines()
    assert lines[0].split() == list(D.STATUS_COLUMNS)
    # rank 1 is dead: the row says so, as the terminal's table does
    assert lines[2].split()[:7] == ["1", "node-a", "101", "cpu", "gloo", "NO", "idle"]
    assert text == D.status_plain(ROWS)
    assert "<table class='dpnb-status'>" in data["text/html"]  # HTML without widget state


def test_training_progress_keeps_its_last_line_as_text(shown):
    p = progress.TrainProgress(total_steps=4, kernel=True)
    p.update(ProgressEvent(rank=0, step=3, loss=0.25, total=4, samples_per_s=10.0))
    p.close(TrainSummary(last_step=3, loss=0.25, steps=4, requested_steps=4))
    kinds = [k for k, _ in shown]
    assert kinds[0] == "display" and kinds[-1] == "update"
    final = shown[-1][1]
    assert WIDGET_VIEW in final and "VBox(" not in final["text/plain"]
    assert final["text/plain"].startswith("step 4/4 | loss 0.2500"), final["text/plain"]


def test_a_quiz_question_keeps_its_question_as_text(shown):
    quiz.ask("Which?", ["x", "y"], 0, ["because", "no"])
    ((_, data),) = shown
    assert data["text/plain"].splitlines() == ["Which?", "  a) x", "  b) y"]
