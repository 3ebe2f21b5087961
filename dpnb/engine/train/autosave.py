"""Checkpoints during training: ``%dp train --checkpoint-every K DIR``.

Every ``K`` steps each rank writes its shards with the same
:func:`dpnb.engine.train.checkpoint.save` as ``%dp save`` (collective: all ranks at
the same step) into ``DIR/step-NNNNNNNN``; rank 0 then points ``DIR/latest``
at it and removes all but the last :data:`KEEP` (and any numbered past it:
after a resume to an earlier step, those belong to an abandoned run).  ``%dp restart --resume``
without a folder loads ``latest``, so an engine lost mid-run costs at most
``K`` steps.  The save is synchronous: DCP's ``async_save`` needs a process
group of its own for its background collectives, which a re-formed dpnb group
would orphan.
"""

from __future__ import annotations

import os
import shutil

from dpnb.engine.train.checkpoint import CheckpointWriteError, read_meta, save
from dpnb.engine.train.train_state import TrainError

LATEST = "latest"
KEEP = 2


def latest(directory: str) -> str | None:
    """The newest checkpoint folder in ``directory``, or None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return None
    path = os.path.join(directory, name)
    return path if os.path.isdir(path) else None


def check(st, directory, every) -> str:
    """Validate ``--checkpoint-every K DIR`` before any step runs; the absolute DIR."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TrainError(f"--checkpoint-every must be a whole number of steps >= 1 (got {every!r})")
    if not isinstance(directory, str) or not directory:
        raise TrainError("--checkpoint-every K DIR needs a folder DIR")
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".dpnb-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise TrainError(f"cannot write checkpoints to {path} ({e.strerror or e}): choose a "
                         "writable folder that every rank can reach") from None
    prev = latest(path)
    if prev is not None:
        keys = sorted(st.module.state_dict().keys())
        try:
            saved = read_meta(prev).get("model_keys")
        except (OSError, ValueError) as e:
            raise TrainError(f"{prev} is not a readable dpnb checkpoint ({e}): choose another "
                             "folder") from None
        if saved is not None and sorted(saved) != keys:
            raise TrainError(f"{path} holds checkpoints of another model ({len(saved)} tensors, "
                             f"this one has {len(keys)}): choose a new folder")
    return path


def save_step(ns: dict, directory: str, step: int, rank: int) -> str:
    """Checkpoint now (collective); rank 0 moves ``latest`` and prunes old ones."""
    name = f"step-{step:08d}"
    try:
        save(ns, os.path.join(directory, name))  # ends with a barrier: every rank has written
    except CheckpointWriteError as e:  # on every rank alike: say what is still there
        prev = latest(directory)
        kept = (f"{os.path.basename(prev)} is intact and still the latest" if prev
                else "no earlier checkpoint is in that folder")
        raise TrainError(f"{e}. Training stopped after step {step - 1:,} (the model holds "
                         f"its weights); {kept}. Train on with another checkpoint_dir, or "
                         f"once there is room") from None
    if rank == 0:
        tmp = os.path.join(directory, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
        os.replace(tmp, os.path.join(directory, LATEST))
        # checkpoints past this step belong to a timeline a resume abandoned
        names = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
        stale = [d for d in names if d > name]
        old = [d for d in names if d <= name][:-KEEP]
        for d in stale + old:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
    return os.path.join(directory, name)
