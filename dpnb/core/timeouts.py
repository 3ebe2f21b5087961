"""How long a process group waits, and how long forming one may take.

Two clocks, kept apart on purpose.  The *group timeout* is what torch gives
``init_process_group(timeout=...)``: how long a collective waits for a peer
that is busy elsewhere before it errors.  dpnb uses torch's own defaults, so
a legitimate wait is cut off no sooner than under torchrun; mistakes never
wait for it (dpnb releases a raising, dead or deadlocked rank's peers in
under a second).  The *formation timeout* bounds joining a group -- the
store connection and the rendezvous behind it -- and the notebook's waits
around a start or a re-form: a rank that cannot join costs about a minute,
never half an hour.
"""

from __future__ import annotations

#: the group timeout when --timeout is not given: torch's own defaults
#: (torch.distributed.constants: default_pg_timeout, 30 min, for gloo; the
#: C++ default for NCCL, 10 min; tests/unit/test_backend_env.py holds them
#: equal), so a rank that legitimately waits for a busy peer (an evaluation
#: on rank 0) is not cut off sooner than under torchrun.  Mistakes do not wait
#: for it: a raising rank, a dead engine and a collective no rank can join are
#: released in under a second whatever this is.
TORCH_DEFAULT_TIMEOUT_S = {"gloo": 1800.0, "nccl": 600.0}
#: forming a group (store, rendezvous) and the notebook's waits around it are
#: bounded by this, not by a 30-minute group timeout: a rank that cannot join
#: fails the start or the re-form in about a minute
FORM_TIMEOUT_S = 60.0


def default_timeout(backend: str) -> float:
    """The group timeout for ``backend`` (``gloo`` / ``nccl``) when none is given."""
    return TORCH_DEFAULT_TIMEOUT_S[backend]


def form_timeout(group_timeout_s: float) -> float:
    """How long forming a group may take: the group timeout, at most FORM_TIMEOUT_S."""
    return min(float(group_timeout_s), FORM_TIMEOUT_S)
