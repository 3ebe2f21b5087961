"""A raising rank, timed: what the shared-host tiers assert while under attack."""

from __future__ import annotations

import time

import pytest

import dpnb


def assert_release_is_fast(c, raising_rank: int, bound_s: float = 1.5) -> float:
    """``raising_rank`` raises while the others wait in an all_reduce: the report
    comes within ``bound_s``, every side door answers ``where``, and the next
    cell and a re-formation work with the cells' state (``keep == 42``) kept.
    Returns the release time."""
    t0 = time.monotonic()
    with pytest.raises(dpnb.RemoteCellError):
        c.run(f"if rank == {raising_rank}: raise ValueError('boom')\n"
              "x = torch.ones(1); dist.all_reduce(x)", display=False)
    release_s = time.monotonic() - t0
    assert release_s < bound_s, release_s
    assert "no answer" not in c.where()
    c.run(f"x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == {c.world_size} "
          "and keep == 42", display=False)
    assert c.reform()["problems"] == []
    return release_s
