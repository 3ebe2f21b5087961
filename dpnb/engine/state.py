"""Per-engine state that dpnb keeps in the engine's user namespace.

Every engine's ``globals()`` (the namespace ``%%dp`` cells run in) holds one
:class:`EngineState` under the name ``_dpnb``.  It records who this rank is and
how its process group was formed, so that engine-side functions that need the
group (training, checkpoints, collectives for views) receive it from here
instead of from module globals, and so that the group can be re-formed after a
collective error without losing anything the user built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATE_NAME = "_dpnb"


@dataclass
class EngineState:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    backend: str  # "gloo" or "nccl"
    device: Any  # torch.device
    master_addr: str
    master_port: int
    timeout_s: float
    # Incremented each time the process group is (re-)formed; objects bound
    # to an older group (DDP, ZeroRedundancyOptimizer, FSDP meshes) compare
    # this to know they must be re-bound.
    generation: int = 0
    # Callbacks ``f(ns, state)`` run on this engine right after the group is
    # re-formed (the training layer registers one to re-bind wrapped models).
    on_reform: list = field(default_factory=list)
    # Free-form slots for higher layers (training, recording, stragglers).
    extras: dict = field(default_factory=dict)


def get_state(ns: dict) -> EngineState:
    """The dpnb state of the engine whose namespace is ``ns``."""
    try:
        return ns[STATE_NAME]
    except KeyError:
        raise RuntimeError(
            "this engine has no dpnb state: it was not started by dpnb.start()"
        ) from None
