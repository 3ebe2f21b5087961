"""One driver at a time on a cluster's ranks (dpnb/cluster/turn.py), and what the
notebook is told of an agent's calls (dpnb/agent/service.py), without a cluster."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from dpnb.agent.service import CALLS_KEPT, AgentCall, AgentService
from dpnb.cluster.turn import Turn, TurnTaken
from dpnb.core.agentgrant import AgentGrant


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(v=fn()))
    t.start()
    t.join(20)
    return out.get("v")


def test_the_notebook_holds_the_turn_reentrantly_and_an_agent_is_told_who_holds_it():
    turn = Turn()
    turn.take_for_notebook()
    turn.take_for_notebook()  # a verb made of calls: the same thread again
    held = _in_thread(lambda: turn.try_take("an agent's run_code"))
    assert held is not None and held.who == "the notebook" and not held.brief
    turn.release()
    assert _in_thread(lambda: turn.try_take("an agent's run_code")) is not None  # still held
    turn.release()
    assert turn.holder is None


def test_the_notebook_is_refused_by_an_agents_long_call_and_waits_out_a_brief_read():
    turn = Turn()
    taken, go = threading.Event(), threading.Event()

    def agent(brief: bool):
        assert turn.try_take("an agent's status" if brief else "an agent's run_code",
                            brief=brief) is None
        taken.set()
        go.wait(10)
        turn.release()

    t = threading.Thread(target=agent, args=(False,))
    t.start()
    taken.wait(10)
    with pytest.raises(TurnTaken, match="the ranks are running an agent's run_code .*"
                                        "%dp interrupt stops it"):
        turn.take_for_notebook()
    go.set()
    t.join(10)

    taken.clear()
    go.clear()
    t = threading.Thread(target=agent, args=(True,))
    t.start()
    taken.wait(10)
    threading.Timer(0.3, go.set).start()  # the read ends a moment later
    t0 = time.monotonic()
    turn.take_for_notebook()  # waited for it, not refused
    assert 0.2 < time.monotonic() - t0 < 5
    turn.release()
    t.join(10)


def test_only_the_thread_that_took_the_turn_releases_it():
    turn = Turn()
    turn.take_for_notebook()

    def other():
        try:
            turn.release()
        except RuntimeError as e:
            return str(e)

    assert "released by the thread that took it" in _in_thread(other)
    assert turn.holder is not None and turn.holder.who == "the notebook"
    turn.release()


def test_the_notebooks_grant_refuses_naming_what_its_user_would_run():
    g = AgentGrant()
    assert "%dp agent --allow-actions" in g.refusal("restart", "actions")
    assert "c.allow_agent(code=True)" in g.refusal("run_code", "code")
    assert AgentGrant(actions=True).refusal("restart", "actions") is None
    assert AgentGrant(actions=True).refusal("run_code", "code") is not None
    assert AgentGrant(code=True).describe() == "reads, code"


def test_the_notebook_prints_each_agent_action_once_even_past_the_calls_kept():
    svc = AgentService(SimpleNamespace(agent_grant=AgentGrant()))
    tools = ("status", "interrupt", "where")  # one action in three
    for i in range(CALLS_KEPT + 50):
        svc.note(AgentCall(time.time(), 4242, tools[i % 3], "", "ok (0.0 s)"))
    kept_actions = sum(1 for k in svc.calls if k.is_action)  # of the latest CALLS_KEPT
    lines = svc.unshown_lines()
    assert len(svc.calls) == CALLS_KEPT and len(lines) == kept_actions > 0
    assert all("interrupt -> ok" in line and "pid 4242" in line for line in lines)
    assert svc.unshown_lines() == []
    svc.note(AgentCall(time.time(), 4242, "reform", "", "ok (0.1 s)"))
    svc.note(AgentCall(time.time(), 4242, "where", "", "ok (0.0 s)"))
    assert [line.split(": ", 2)[-1] for line in svc.unshown_lines()] == ["reform -> ok (0.1 s)"]
