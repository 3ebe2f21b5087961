"""A rank's open-file limit follows its group's size (dpnb.engine.process)."""

from __future__ import annotations


def test_a_rank_raises_its_open_file_limit_to_what_its_group_needs(monkeypatch):
    """Rank 0 of 1,024 holds ~3 N connections (store, check star, gloo pairs):
    past a 1,024 soft limit.  The soft limit goes up, never past the hard one."""
    import resource

    from dpnb.engine import process

    set_to = []
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: set_to.append(lim))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1_048_576))
    assert process.raise_fd_limit(1024) == 4 * 1024 + 256 and set_to == [(4352, 1_048_576)]
    assert process.raise_fd_limit(8) == 1024 and len(set_to) == 1  # enough already: untouched
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 2048))
    assert process.raise_fd_limit(1024) == 2048 and set_to[-1] == (2048, 2048)
