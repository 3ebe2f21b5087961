"""Each rank's random generators, seeded as torchrun's processes find them.

Under torchrun every rank is a fresh interpreter: torch seeds its default
generator from the operating system's entropy at import (torch 2.13:
``torch.initial_seed()`` differs from run to run and between ranks), numpy's
global ``RandomState`` and Python's ``random`` do the same.  An unseeded
script therefore draws different numbers -- data, dropout masks, noise -- on
every rank.

dpnb's engines are not fresh interpreters: local engines are forked from one
zygote that imported torch and numpy once (:mod:`dpnb.engine.hostagent`), so
without this module every rank would start with the zygote's generator state
and draw the *same* numbers (Python's ``random`` alone reseeds itself after a
fork).  :func:`seed_rank` runs once per engine process, in
:func:`dpnb.engine.setup.init_rank`, before any user code -- for engines
started, forked, replaced by ``%dp restart``, added by ``%dp resize`` alike --
and nothing crosses the wire: each rank seeds itself.  A re-formed group or a
soft restart keeps the process, so it keeps its generators' state.

``%dp start --seed S`` (``dpnb.start(seed=S)``) makes a session reproducible:
rank ``r`` seeds every generator with ``S + r``, exactly as a torchrun script
that begins with ``torch.manual_seed(S + rank)``, ``numpy.random.seed(S +
rank)``, ``random.seed(S + rank)`` would.  A replaced rank gets its rank's
seed again (its old generator state died with it).
"""

from __future__ import annotations

import random
import sys

#: numpy's legacy seeding takes 32 bits
_NUMPY_SEED_MOD = 2 ** 32


def rank_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank`` uses under ``--seed seed``: ``seed + rank``."""
    return int(seed) + int(rank)


def seed_rank(rank: int, seed: int | None) -> int:
    """Seed torch (CPU and, lazily, every CUDA device), numpy and ``random``.

    ``seed`` None: fresh entropy for each generator, as a new process gets.
    Returns torch's seed for this rank (``torch.initial_seed()`` after).
    """
    # lazy: torch-free at import (boot loads torch in a background thread)
    import torch

    if seed is None:
        # torch.seed() draws a non-deterministic seed and hands it to every
        # CUDA device's generator too, queued until CUDA starts
        s = torch.seed()
        random.seed()  # os.urandom
        np = sys.modules.get("numpy")  # torch imports it when installed
        if np is not None:
            np.random.seed()  # the OS's entropy
        return int(s)
    s = rank_seed(seed, rank)
    torch.manual_seed(s)  # CPU and (lazily) every CUDA device
    random.seed(s)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(s % _NUMPY_SEED_MOD)
    return s
