"""Per-engine state that dpnb keeps in the engine's user namespace.

Every engine's ``globals()`` (the namespace ``%%dp`` cells run in) holds one
:class:`EngineState` under the name ``_dpnb``.  It records who this rank is and
how its process group was formed, so that engine-side functions that need the
group (training, checkpoints, collectives for views) receive it from here
instead of from module globals, and so that the group can be re-formed after a
collective error without losing anything the user built.

The slots of the higher layers (training, timing hooks, stragglers, stop
requests) are typed fields here rather than a free-form dict, so every reader
and writer of a slot can be found by name.
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
    # -- slots of the higher layers (kept across a re-init of this rank) --
    train: Any = None  # dpnb.engine.train.train_state.TrainState once a model is wrapped
    pending_data: Any = None  # a DataState chosen before the first wrap
    peer: Any = None  # dpnb.engine.train.peercopy.PeerState: own snapshot, neighbour's copy
    watch: Any = None  # dpnb.engine.metrics.views timing hooks for the gradsync view
    straggle_delay_s: float = 0.0  # injected per-step delay (%dp straggle)
    stop_requested: bool = False  # the Stop button: end training at a step boundary
    stop_file: str | None = None  # ... or this file appearing (any rank)
    store_sock: Any = None  # rank 0: the listening socket of the next group's store
    store_server: Any = None  # rank 0: dpnb.engine.group.authstore.StoreServer of the current group
    token: str | None = None  # the cluster's secret: store, side door and check star
    # the current group's store as a Python object: torch holds only its C++
    # half, and a store written in Python answers only while this one lives
    store: Any = None
    releases: int = 0  # side-door releases of this process's groups (the optimizer-step gate)
    side_door: Any = None  # dpnb.engine.sidedoor.SideDoor: release / where, from any thread
    cell_guard: Any = None  # dpnb.engine.cell.cellguard.Guard: counts and checks cells' collectives
    cell_calls: dict = field(default_factory=dict)  # collectives run by the current cell, by op
    current_collective: Any = None  # {"op", "seq", "group", ...} while a cell is inside one
    # NCCL: an event recorded on the stream right after the last collective
    # dpnb saw issued (dpnb.engine.device.mark_collective); not yet passed,
    # a device wait on this rank includes a collective (the deadlock rule)
    collective_mark: Any = None
    debugger: Any = None  # dpnb.engine.debugging.rankpdb.RankPdb while this rank is stopped in pdb
    lifecycle: Any = None  # dpnb.engine.group.lifecycle's replacements of init/destroy_process_group
    pdb_hooks: Any = None  # dpnb.engine.debugging.rankpdb's breakpoint() / pdb.set_trace replacements
    debug_detached: bool = False  # the notebook cannot prompt: skip breakpoints this cell
    debug_used: bool = False  # a breakpoint stopped this cell (tracing to undo at its end)
    # (key, intra-host group, inter-host group) of dpnb.engine.metrics.hierbench; the
    # key holds the generation, so a re-formed group forms new subgroups
    subgroups: Any = None
    profiler: Any = None  # dpnb.engine.metrics.profile's running torch.profiler, between begin and end
    profile_blob: Any = None  # a profiled cell's gzipped trace too big for its reply, until taken
    # what this cell's execute_reply carries home (name -> text), emptied as it is sent
    # (dpnb.engine.cell.outcount.CARRY_KEY): a profiled cell's record, its end inside the cell's request
    carry: dict = field(default_factory=dict)
    # the default group this rank formed last, held here because c10d forgets
    # it: an NCCL release aborts the groups, which empties c10d's world map
    # (dist.group.WORLD is None), and the re-formation must still know which
    # group the user's DDP/ZeRO/FSDP2 objects are bound to
    group: Any = None
    # dpnb.engine.gradesandbox, grading a roster: what the guarded modules bound before any
    # submission, the namespace before this one, and its kernel cells' own namespace
    grading_reference: Any = None
    grading_baseline: Any = None
    grading_kernel: Any = None
    grading_kernel_at: Any = None

    @property
    def comm_device(self):
        """Where this rank's collectives' tensors live: its GPU under NCCL, else the
        CPU (gloo reduces host memory; a training step's model may still be on a GPU)."""
        # lazy: torch-free at import (boot loads torch in a background thread)
        import torch

        return torch.device(self.device) if self.backend == "nccl" else torch.device("cpu")

    def carry_from(self, old: "EngineState") -> None:
        """Keep what higher layers registered when this rank is re-initialised."""
        self.on_reform = old.on_reform
        self.generation = old.generation
        for name in ("train", "pending_data", "peer", "watch", "straggle_delay_s", "stop_requested",
                     "stop_file", "store_sock", "store_server", "store", "releases", "side_door",
                     "cell_guard", "lifecycle", "pdb_hooks", "group", "grading_reference",
                     "grading_baseline", "grading_kernel"):
            setattr(self, name, getattr(old, name))


def get_state(ns: dict) -> EngineState:
    """The dpnb state of the engine whose namespace is ``ns``."""
    try:
        return ns[STATE_NAME]
    except KeyError:
        raise RuntimeError(
            "this engine has no dpnb state: it was not started by dpnb.start()"
        ) from None
