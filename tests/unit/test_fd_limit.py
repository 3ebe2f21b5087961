"""What grows with N on a rank and its host: the open-file limit (dpnb.engine.proc.process), the wait for an agent's engines (dpnb.cluster.agents)."""

from __future__ import annotations


def test_a_rank_raises_its_open_file_limit_to_what_its_group_needs(monkeypatch):
    """Rank 0 of 1,024 holds ~3 N connections (store, check star, gloo pairs):
    past a 1,024 soft limit.  The soft limit goes up, never past the hard one."""
    import resource

    from dpnb.engine.proc import process

    set_to = []
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: set_to.append(lim))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1_048_576))
    assert process.raise_fd_limit(1024) == 4 * 1024 + 256 and set_to == [(4352, 1_048_576)]
    assert process.raise_fd_limit(8) == 1024 and len(set_to) == 1  # enough already: untouched
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 2048))
    assert process.raise_fd_limit(1024) == 2048 and set_to[-1] == (2048, 2048)


def test_the_wait_for_an_agent_s_start_grows_with_its_engines():
    """128 engines forked on 2 cores took longer than the 30 s any reply gets."""
    from dpnb.cluster import agents

    asked = []

    class Agent:
        class proc:  # connected: a start revives no agent
            poll = staticmethod(lambda: None)

        def request(self, cmd, timeout=agents.REPLY_TIMEOUT_S, **fields):
            asked.append((cmd, fields["n"], timeout))
            return {"pids": list(range(fields["n"]))}

    a = agents.Agents.__new__(agents.Agents)
    a.agents = {"h1": Agent(), "h2": Agent()}
    assert a.start({"h1": 128, "h2": 2}) == {"h1": list(range(128)), "h2": [0, 1]}
    assert sorted(asked) == [("start", 2, 31.0), ("start", 128, 94.0)]
