"""A raising rank, timed: the REPL's most common distributed mistake, spelled in
one place for every tier -- one rank raises before an all_reduce its peers have
already entered, and dpnb must release them (what the shared-host tiers assert
while under attack, what the 3- and 8-rank tests and the ecosystem's rebinds use
as their trigger)."""

from __future__ import annotations

import time

import pytest

import dpnb


def raise_before_all_reduce(c, rank: int = 1, exc: str = "ValueError('typo')",
                            **run_kw) -> tuple[dpnb.RemoteCellError, float]:
    """Rank ``rank`` raises ``exc`` at cell line 3; the others enter the
    all_reduce.  Returns the cell's error and how long the cell took."""
    t0 = time.monotonic()
    with pytest.raises(dpnb.RemoteCellError) as ei:
        c.run(f"t = torch.ones(1)\nif rank == {rank}:\n    raise {exc}\ndist.all_reduce(t)",
              display=False, **run_kw)
    return ei.value, time.monotonic() - t0


def assert_release_is_fast(c, raising_rank: int, bound_s: float = 1.5) -> float:
    """``raising_rank`` raises while the others wait in an all_reduce: the report
    comes within ``bound_s``, every side door answers ``where``, and the next
    cell and a re-formation work with the cells' state (``keep == 42``) kept.
    Returns the release time."""
    _, release_s = raise_before_all_reduce(c, raising_rank, "ValueError('boom')")
    assert release_s < bound_s, release_s
    assert "no answer" not in c.where()
    c.run(f"x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == {c.world_size} "
          "and keep == 42", display=False)
    assert c.reform()["problems"] == []
    return release_s
