"""An unseeded torchrun script draws different numbers on each rank, under
torchrun and under ``%dp run`` alike (local engines are forked from one
process; without dpnb's per-rank seeding both ranks trained on the same noise
with the same dropout masks and printed the same losses)."""

from __future__ import annotations

import re

from helpers.ecosystem import assert_whole, script, torchrun


def _per_rank(text: str) -> dict[int, tuple]:
    """rank -> (checksum, jitter, losses) from the script's lines."""
    out: dict[int, tuple] = {}
    for r in (0, 1):
        head = re.search(rf"rank {r} checksum (-?\d+\.\d{{6}}) jitter (\d\.\d{{6}})", text)
        losses = tuple(float(x) for x in re.findall(rf"rank {r} step \d+ loss (\d+\.\d{{6}})", text))
        assert head and len(losses) == 3, text
        out[r] = (float(head.group(1)), float(head.group(2)), losses)
    return out


def test_an_unseeded_script_draws_its_own_data_on_each_rank_as_under_torchrun(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    ref = _per_rank(torchrun("unseeded_train.py", cwd=tmp_path))
    # the reference: torchrun's two processes differ in torch's data and numpy's draw
    assert ref[0][0] != ref[1][0] and ref[0][1] != ref[1][1] and ref[0][2] != ref[1][2]
    res = c.run_script(script("unseeded_train.py"), [], display=False)
    got = _per_rank(res.outcomes[0].stdout + res.outcomes[1].stdout)
    for k, what in enumerate(("torch data", "numpy draw", "local losses")):
        assert got[0][k] != got[1][k], f"{what} equal on both ranks: {got}"
    assert_whole(c, pids)
