"""The ecosystem tier: other people's kind of code on real 2-rank gloo clusters.

Scripts in ``scripts/`` are written the way torchrun scripts are written
(argparse, ``init_process_group`` from the environment, a main guard,
``destroy_process_group`` at the end); cells build DDP, FSDP2, ZeRO and
Accelerate objects themselves.  Every test ends by checking the cluster is
whole (:func:`helpers.ecosystem.assert_whole`): the same engine PIDs, a next cell, ``new_group``,
``reform`` and ``restart`` (without ``--hard``), everything defined kept.
"""

from __future__ import annotations

import pytest

import dpnb



@pytest.fixture(scope="module")
def c():
    cl = dpnb.start(2)  # the default group timeout (torch's 30 min): every "at once" below is far from it
    yield cl
    cl.stop()
