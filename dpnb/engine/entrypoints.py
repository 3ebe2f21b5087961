"""Every engine function the notebook side calls, named once.

The notebook never pickles a closure to a rank: it sends a dotted name
(``cluster.call(TRAIN, ...)`` travels as ``"dpnb.engine.train.training.train"``)
and each engine imports and calls it (:func:`dpnb.engine.runner.call`).
The runtime (:mod:`dpnb.cluster`), the session, the views and the magics
import these names from here instead of spelling the strings, so a rename
on the engine side is one edit here and tests/unit/test_entry_points.py
resolves each of them the way an engine does.  The session's setup record
(:mod:`dpnb.session.record`) holds typed steps, each naming the entry point
it replays from here.

Plain ``str`` constants (not a ``str`` subclass): the value crosses
ipyparallel as a bare string, exactly as before, and a kept cluster's JSON
record is unchanged.  This module imports nothing, so the notebook side may
import it without importing torch (``dpnb.engine/__init__`` imports nothing
either).
"""

from __future__ import annotations

from typing import Final

# ----------------------------------------------------------- modules (by name)
#: the engine's entry script (``python -m``), launched by every launcher
BOOT_MODULE: Final = "dpnb.engine.boot"
#: the per-host agent / zygote (``python -m``) the ssh and local launchers start
HOSTAGENT_MODULE: Final = "dpnb.engine.hostagent"
#: modules an exported batch job imports under a short alias (dpnb.session.export)
#: the room an exported job imports ``checkpoint``, ``job`` and ``training`` from
TRAIN_ROOM: Final = "dpnb.engine.train"
TRAINING_MODULE: Final = "dpnb.engine.train.training"
CHECKPOINT_MODULE: Final = "dpnb.engine.train.checkpoint"

# ------------------------------------------------------------- the runtime's
POST_MORTEM: Final = "dpnb.engine.debugging.rankpdb.post_mortem"
HAS_NAMES: Final = "dpnb.engine.runner.has_names_ns"
LOG_RECORDS: Final = "dpnb.engine.runner.log_records"

# ------------------------------------------------------------ training verbs
WRAP: Final = "dpnb.engine.train.training.wrap"
SET_DATA: Final = "dpnb.engine.train.training.set_data"
TRAIN: Final = "dpnb.engine.train.training.train"
RECORDS: Final = "dpnb.engine.train.training.records"
SCALE_LR: Final = "dpnb.engine.train.training.scale_lr"
CHECK: Final = "dpnb.engine.train.check.check"
SAVE: Final = "dpnb.engine.train.checkpoint.save"
LOAD: Final = "dpnb.engine.train.checkpoint.load"
FULL_STATE_DICT: Final = "dpnb.engine.train.checkpoint.full_state_dict"

# ----------------------------------------------------------------- profiling
PROFILE_BEGIN: Final = "dpnb.engine.metrics.profile.begin"
PROFILE_END: Final = "dpnb.engine.metrics.profile.end"
PROFILE_DROP: Final = "dpnb.engine.metrics.profile.drop"
PROFILE_TAKE: Final = "dpnb.engine.metrics.profile.take"
PROFILE_ARM: Final = "dpnb.engine.metrics.profilemark.arm"

# ------------------------------------------------- JupyterLab's debugger
DAP_ARM: Final = "dpnb.engine.debugging.rankdap.arm"

# --------------------------------------------------------------------- views
WATCH: Final = "dpnb.engine.metrics.views.watch"
LIVE_SUMMARY: Final = "dpnb.engine.metrics.views.live_summary"
MEMORY_SNAPSHOT: Final = "dpnb.engine.metrics.views.memory_snapshot"
GRADSYNC_RECORDS: Final = "dpnb.engine.metrics.views.gradsync_records"
STEP_VIEWS: Final = "dpnb.engine.metrics.views.step_views"
#: each rank's thinned steps for ``%dp incidents`` (dpnb.widgets.incidents)
STEP_SERIES: Final = "dpnb.engine.metrics.views.step_series"
BENCH_COLLECTIVE: Final = "dpnb.engine.metrics.views.bench_collective"
RING_DEMO: Final = "dpnb.engine.metrics.views.ring_demo"
SET_STRAGGLE: Final = "dpnb.engine.metrics.views.set_straggle"
STRAGGLE_STATE: Final = "dpnb.engine.metrics.views.straggle_state"
BENCH_HIERARCHICAL: Final = "dpnb.engine.metrics.hierbench.bench_hierarchical"
MEASURE_RESIDENCY: Final = "dpnb.engine.metrics.residency.measure_step"

# ------------------------------------------------------ recovery from memory
#: what each survivor holds (a replica, peer copies), asked before anything is replaced
REPLICA_INFO: Final = "dpnb.engine.train.rebuild.replica_info"
#: every rank: the replaced one takes a survivor's replica over the re-formed group
FROM_REPLICA: Final = "dpnb.engine.train.rebuild.from_replica"
#: every rank rolls back to its snapshot; the replaced one takes its neighbour's copy
FROM_PEERS: Final = "dpnb.engine.train.rebuild.from_peers"
#: every rank: the peer copies' interval (``%dp train --peer-copy-every K``)
PEER_SET_EVERY: Final = "dpnb.engine.train.peercopy.set_every"
#: each rank's peer copies: interval, bytes held (``%dp memory``)
PEER_INFO: Final = "dpnb.engine.train.peercopy.info"
PEER_ROLL_BACK: Final = "dpnb.engine.train.peercopy.roll_back_pair"

# ------------------------------------------------------------------- grading
#: one exercise case on every rank (``%dp grade``; dpnb.session.grading)
GRADE_CASE: Final = "dpnb.engine.grading.run_case"
#: a roster's submission (``dpnb grade``; dpnb.session.roster): the namespace kept, a
#: kernel cell on rank 0, dpnb's counters checked untouched, the namespace given back
GRADE_BEGIN: Final = "dpnb.engine.gradesandbox.begin"
GRADE_KERNEL_CELLS: Final = "dpnb.engine.gradesandbox.kernel_cells"
GRADE_KERNEL_AT: Final = "dpnb.engine.gradesandbox.kernel_at"
GRADE_READY: Final = "dpnb.engine.gradesandbox.ready"
GRADE_END: Final = "dpnb.engine.gradesandbox.end"


#: entry points a kept cluster's record may name as dpnb wrote them before the
#: engine's rooms (2026-11-28): read back as today's (dpnb.session.record)
RENAMED: Final = {
    "dpnb.engine.training.wrap": WRAP,
    "dpnb.engine.training.set_data": SET_DATA,
    "dpnb.engine.views.watch": WATCH,
}


def all_names() -> dict[str, str]:
    """Every constant above, by its Python name (the entry-point test resolves each)."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)}
