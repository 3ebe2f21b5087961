"""Training progress as one typed event: encoded on the rank, decoded once, fanned out.

Rank 0 publishes a :class:`~dpnb.core.events.ProgressEvent` through datapub;
the notebook decodes it once and the session's feed hands it to every
subscriber -- the live view for the call, the dashboard, JupyterLab's
sidebar.  A broken subscriber is logged and the others still hear it.
"""

from __future__ import annotations

import logging
import threading

from dpnb.core.events import ProgressEvent
from dpnb.core.viewsource import LastRun
from dpnb.session.feed import ProgressFeed


def test_an_event_round_trips_through_the_datapub_payload():
    ev = ProgressEvent(rank=0, step=4, done=2, total=3, loss=0.5, samples_per_s=10.0,
                       history=[(3, 0.6, 9.0), (4, 0.5, 10.0)])
    payload = ev.encode()
    assert list(payload) == ["dpnb_progress"] and payload["dpnb_progress"]["step"] == 4
    assert ProgressEvent.decode(payload) == ev
    assert ProgressEvent.decode({"other": 1}) is None and ProgressEvent.decode(None) is None
    assert ProgressEvent.decode({"dpnb_progress": {"step": 1}}) is None  # no rank: not one
    # a newer dpnb's extra key is left out, not fatal
    assert ProgressEvent.decode({"dpnb_progress": {"rank": 1, "step": 2, "new": 0}}).step == 2


def test_the_feed_calls_every_subscriber_and_a_broken_one_is_logged(caplog):
    feed, heard = ProgressFeed(), []

    def broken(ev):
        raise RuntimeError("view bug")

    feed.subscribe(broken)
    unsub = feed.subscribe(heard.append)
    ev = ProgressEvent(rank=0, step=1)
    with caplog.at_level(logging.WARNING, logger="dpnb.session.feed"):
        feed.publish(ev)
    assert heard == [ev] and "view bug" in caplog.text
    unsub()
    feed.publish(ProgressEvent(rank=0, step=2))
    assert heard == [ev] and len(feed) == 1


def test_the_dashboard_shows_an_event_the_session_handed_it():
    from dpnb.widgets import dashboard

    class Source:
        world_size, backend, ranks, running, last_profile = 1, "gloo", (), True, None
        feed = ProgressFeed()

        def subscribe(self, fn):
            return self.feed.subscribe(fn)

        def in_flight(self):
            return True

        def published_progress(self, seen):
            return {}  # nothing read from the client: the event came by subscription

        def last_run(self):
            return LastRun({})

    class Box:
        def refresh(self):
            pass

    src = Source()
    state = {"status": [], "summaries": [], "progress": {}, "history": {}, "running": False}
    poller = dashboard._Poller(Box(), src, state, threading.RLock(), 1.0)
    src.feed.publish(ProgressEvent(rank=0, step=7, loss=0.25, history=[(7, 0.25, 3.0)]))
    poller.tick()
    assert state["progress"][0]["step"] == 7 and state["history"][7] == [7, 0.25, 3.0]
