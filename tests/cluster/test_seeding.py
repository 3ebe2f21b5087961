"""Every rank draws its own random numbers, as torchrun's fresh processes do.

Local engines are forked from one zygote that imported torch and numpy, so
without dpnb's seeding every rank would start from the zygote's generator
state and draw the same numbers (measured before: ``torch.initial_seed()``,
``torch.rand`` and ``np.random.rand`` equal on both ranks; Python's
``random`` alone reseeds after a fork).  ``--seed S`` gives rank r exactly
what ``torch.manual_seed(S + r)``, ``np.random.seed(S + r)``,
``random.seed(S + r)`` give in a plain process -- computed here, in the test
process, independently of the engines.
"""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
import torch

import dpnb

DRAW = ("import numpy as np, random\n"
        "_draw = (torch.initial_seed(), torch.rand(2).tolist(), float(np.random.rand()),"
        " random.random())")


def _draws(c) -> list[tuple]:
    assert c.run(DRAW, display=False).ok
    return [tuple(d) for d in c.pull("_draw")]


def _all_differ(draws: list[tuple]) -> None:
    """No generator starts where another rank's does."""
    assert len(draws) == 2
    for k, what in enumerate(("torch seed", "torch.rand", "numpy", "random")):
        assert draws[0][k] != draws[1][k], f"{what} equal on both ranks: {draws}"


def _reference(seed: int) -> tuple:
    """What a fresh process that seeds itself with ``seed`` draws first."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    return (seed, torch.rand(2).tolist(), float(np.random.rand()), random.random())


def _kill_and_replace(c, rank: int) -> None:
    os.kill(c.ranks[rank].pid, signal.SIGKILL)
    with pytest.raises(dpnb.RemoteCellError) as ei:  # the next cell finds it dead
        c.run("dist.barrier()", display=False)
    assert rank in ei.value.died
    assert f"rank {rank} replaced" in c.restart()


def test_every_rank_draws_its_own_numbers_after_start_restart_and_replacement():
    c = dpnb.start(2, timeout=8)  # local engines, forked from one zygote
    try:
        first = _draws(c)
        _all_differ(first)
        c.restart(hard=True)  # two new processes
        again = _draws(c)
        _all_differ(again)
        assert again[0][0] not in (first[0][0], first[1][0])
        # a replaced rank is forked from the same zygote: it must not start
        # where the zygote's generators stood (nor where the survivor did)
        survivor_seed = again[0][0]
        _kill_and_replace(c, 1)
        assert c.run("_s = torch.initial_seed()", display=False).ok
        seeds = c.pull("_s")
        assert seeds[0] == survivor_seed and seeds[1] not in (survivor_seed, again[1][0])
    finally:
        c.stop()


def test_seed_gives_rank_r_the_numbers_of_seed_plus_r_and_a_replacement_its_own_again():
    c = dpnb.start(2, timeout=8, seed=1234)
    try:
        assert c.seed == 1234
        assert _draws(c) == [_reference(1234), _reference(1235)]
        _kill_and_replace(c, 1)
        got = _draws(c)
        assert got[1] == _reference(1235)  # its rank's seed, not the survivor's state
        assert got[0] != _reference(1234)  # rank 0 went on drawing from where it was
    finally:
        c.stop()


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True])
def test_a_bad_seed_is_refused_before_anything_starts(bad):
    t0 = time.monotonic()
    with pytest.raises(dpnb.DpnbError, match="--seed must be a whole number"):
        dpnb.start(2, seed=bad)
    assert time.monotonic() - t0 < 2  # refused by the argument check, no engine started


def test_an_exported_job_seeds_its_ranks_as_the_notebook_did(tmp_path):
    """``%dp export`` of a ``--seed S`` session: the job's rank r starts at S + r
    too (here one torchrun-like process, rank 0 of 1, env:// rendezvous)."""
    import socket
    import subprocess
    import sys

    from dpnb.session import export

    init = export.init_call(77)  # the line export.script writes into train.py
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    code = ("from dpnb.engine.train import job\nimport torch\nimport torch.distributed as dist\n"
            "class args: backend = 'gloo'; timeout = 30\n"
            f"{init}\nprint(torch.initial_seed())\ndist.destroy_process_group()\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "77"
