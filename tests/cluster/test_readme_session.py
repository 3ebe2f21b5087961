"""The README's "A first session", cell by cell, exactly as written there: a
newcomer who pastes it gets a trained DDP model and the gradient-sync view."""

from __future__ import annotations

from helpers import nbutil as nbu

import dpnb


def first_session_cells() -> list[str]:
    text = (nbu.REPO / "README.md").read_text()
    block = text.split("## A first session", 1)[1].split("```", 2)[1]
    cells: list[list[str]] = []
    for line in block.strip("\n").splitlines():
        if line.startswith("%"):
            cells.append([line])
        else:
            cells[-1].append(line)
    return ["\n".join(c) for c in cells]


def test_the_readmes_first_session_runs_as_written(ip, capsys):
    cells = first_session_cells()
    assert cells[0] == "%load_ext dpnb" and cells[1].startswith("%dp start")
    assert 5 <= len(cells) <= 8, cells  # the first screen's promise
    for cell in cells:
        r = ip.run_cell(cell)
        assert r.success, (cell, r.error_before_exec or r.error_in_exec)
    c = dpnb.get_cluster(ip)
    assert c is not None and c.world_size == 2
    out = capsys.readouterr().out
    assert "2 ranks up" in out
    # 50 steps trained under DDP, the replicas in sync, a step's buckets drawn
    assert c.training.last_wrap.strategy == "ddp" and c.training.steps_done == 50
    assert c.check()["ok"], c.check()
    assert "gradsync" in out.lower() or "bucket" in out.lower(), out[-2000:]
