"""Running an exported notebook session as a batch job (``%dp export``'s ``train.py``).

Under ``torchrun`` (or ``srun torchrun``) each process is one rank.  The
exported script calls :func:`init` with its module namespace: that namespace
then plays the part of an engine's ``%%dp`` namespace -- ``rank``,
``world_size``, ``local_rank``, ``device``, ``torch``, ``dist`` and dpnb's
per-rank state -- so the setup cells copied from the notebook, and the same
engine functions the notebook called by name (``dpnb.engine.train.training.wrap``,
``.set_data``, ``.train``, ``dpnb.engine.train.checkpoint.load``), run unchanged.

Communication is what the notebook's ranks did: one ``init_process_group``
from torchrun's environment (``env://``: rank 0's store at MASTER_ADDR),
then the training steps' gradient collectives, and DCP's collectives when a
checkpoint is loaded or saved.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from datetime import timedelta

# only the exported train.py imports this module, in a process that trains:
# nothing here needs to stay torch-free
import torch
import torch.distributed as dist

from dpnb import compat
from dpnb.core.trainargs import TrainArgs
from dpnb import log as dpnb_log
from dpnb.engine.train import checkpoint, training
from dpnb.engine.group.netplan import group_backend
from dpnb.engine.proc.seeding import seed_rank
from dpnb.engine.state import STATE_NAME, EngineState

log = logging.getLogger(__name__)


def arg_parser(*, description: str, resume: str | None, steps_done: int,
               base: tuple[str, int] | None = None) -> argparse.ArgumentParser:
    """The exported script's command line.  ``base``: the checkpoint (path, step)
    the notebook loaded after its wrap, where its training calls start."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--resume", default=resume, metavar="DIR",
                   help=f"checkpoint to start from (default: {resume or 'none: start fresh'})")
    start = (f"from {base[0]} (step {base[1]}), which the notebook loaded" if base else
             "from the freshly built model")
    p.add_argument("--from-scratch", action="store_true",
                   help="ignore the checkpoint: replay every training call of the notebook "
                        f"({steps_done} steps) {start}")
    p.add_argument("--steps", type=int, default=0,
                   help="train this many more steps after the notebook's, with its last settings")
    p.add_argument("--out", default="checkpoints", metavar="DIR",
                   help="where checkpoints are written (default: ./checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="also checkpoint every K steps (default: only at the end)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: nccl when this process has a GPU, else gloo")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective waits for a peer before it errors")
    return p


def init(ns: dict, *, backend: str = "auto", timeout_s: float = 600.0,
         seed: int | None = None) -> dict:
    """Join torchrun's process group and make ``ns`` look like an engine's namespace.

    ``seed``: the notebook's ``--seed``, so the job's ranks draw what the
    notebook's did (rank r: ``seed + r``); None leaves torchrun's fresh seeds.
    """
    dpnb_log.install()
    compat.ensure_single_collectives()
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not set: run this script with torchrun "
                         f"(see run.sh) or srun torchrun (see job.sbatch)")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if seed is not None:
        seed_rank(rank, seed)
    local_rank = int(env.get("LOCAL_RANK", 0))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=group_backend(backend), timeout=timedelta(seconds=timeout_s), **kwargs)
    state = EngineState(rank=rank, world_size=world, local_rank=local_rank,
                        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                        node_rank=int(env.get("GROUP_RANK", 0)), backend=backend,
                        device=device, master_addr=env["MASTER_ADDR"],
                        master_port=int(env["MASTER_PORT"]), timeout_s=timeout_s, generation=1)
    ns[STATE_NAME] = state
    ns.update(rank=rank, world_size=world, local_rank=local_rank, device=device, torch=torch,
              dist=dist)
    return {"rank": rank, "world_size": world, "backend": backend, "device": str(device)}


def remaining(schedule: list[dict], done: int) -> list[dict]:
    """The training calls of ``schedule`` still to run when ``done`` steps are done.

    Each entry is one notebook ``train`` call with the steps it really ran;
    a call the checkpoint cut through runs only its remaining steps.
    """
    out, start = [], 0
    for call in schedule:
        end = start + int(call["steps"])
        if end > done:
            out.append({**call, "steps": end - max(start, done)})
        start = end
    return out


def _start(ns: dict, args, base: tuple[str, int] | None) -> int:
    """Load what the job starts from; the step the schedule's calls count from."""
    if args.resume and not args.from_scratch:
        info = checkpoint.load(ns, args.resume)
        return int(info.get("step") or 0)
    if base is None:
        return 0
    if not os.path.isdir(base[0]):
        raise SystemExit(f"--from-scratch replays the notebook from {base[0]} (step {base[1]}), "
                         f"which it loaded, and that folder is gone: copy it back or drop "
                         f"--from-scratch")
    checkpoint.load(ns, base[0])
    return base[1]


def run(ns: dict, schedule: list[dict], args, base: tuple[str, int] | None = None) -> dict:
    """Load the checkpoint (unless ``--from-scratch``: then the one the notebook
    loaded after its wrap, ``base``, if any), run what is left of the notebook's
    training calls (counted from ``base``'s step), then ``--steps`` more;
    checkpoint at the end.

    Rank 0 prints each call's steps and losses; every rank returns the last
    summary.  The global batch of each call is the notebook's (micro-batch x
    world size x grad-accum): run with the notebook's number of ranks to keep it.
    """
    es = ns[STATE_NAME]
    say = print if es.rank == 0 else (lambda *a, **k: None)
    done = _start(ns, args, base)
    if args.resume and not args.from_scratch:
        say(f"resumed from {args.resume} at step {done}")
    elif base:
        say(f"loaded {base[0]} at step {done}, as the notebook did")
    calls = remaining(schedule, done - (base[1] if base else 0))
    if args.steps:
        if not schedule:
            raise SystemExit("--steps needs the settings of a training call, and the notebook "
                             "made none")
        calls.append({**schedule[-1], "steps": int(args.steps)})
    out = os.path.abspath(args.out)
    summary = None
    for call in calls:
        kw = {k: v for k, v in call.items() if k not in ("steps", "epochs")}
        if args.checkpoint_every:
            kw.update(checkpoint_every=args.checkpoint_every, checkpoint_dir=out)
        summary = training.train(ns, TrainArgs(steps=int(call["steps"]), publish=False, **kw))
        say(f"steps {summary.first_step}-{summary.last_step}: global batch "
            f"{summary.global_batch}, loss " + " ".join(f"{x:.6g}" for x in summary.losses))
    if calls:
        final = os.path.join(out, f"step-{training.train_state(ns).step:08d}")
        checkpoint.save(ns, final)
        say(f"final loss {summary.loss:.9g} at step {summary.last_step}; saved {final}")
    else:
        say("nothing to train: the checkpoint is past every training call (add --steps N)")
    finish(ns)
    return summary


def gloo_workers() -> int:
    """How many of gloo's C++ threads (a group's work loops, its transport's
    event loop) this process still runs; 0 where ``/proc`` is missing."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith(("pt_gloo", "gloo_"))
        except OSError:  # the thread ended while we listed
            continue
    return n


def finish(ns: dict) -> None:
    """End the job's process group while Python is whole, and wait for gloo's threads.

    Why: a gloo group runs each collective on a C++ work thread, which drops
    its reference to the finished work (and so to the tensors the collective
    touched) only after the rank's ``wait()`` has returned.  When that last
    drop races with interpreter teardown it must take the GIL to free a
    tensor's Python object, finalization ends the thread inside a ``noexcept``
    destructor, and the process aborts ("terminate called without an active
    exception", exit -6) -- after it has trained and saved (the mechanism
    pytorch/pytorch PR #179291, closed unmerged, describes).
    ``destroy_process_group()`` alone does not help: it only unregisters the
    group, which lives on in DDP's reducer (``ns[model_out]``) and dpnb's
    state until teardown.  So: destroy it, drop dpnb's objects that hold it,
    and let the last reference go from the group's Python handle, whose
    destructor releases the GIL and joins the work threads.  Nothing is sent:
    each rank only waits for its own threads.  Inside a dpnb engine the
    destroy is dpnb's noted no-op (:mod:`dpnb.engine.group.lifecycle`) and nothing
    is dropped.
    """
    handle = dist.group.WORLD if dist.is_initialized() else None
    if handle is None:
        return
    dist.destroy_process_group()
    if dist.is_initialized():  # an engine's group: it stays up, and so does its state
        return
    es = ns.pop(STATE_NAME, None)
    st = getattr(es, "train", None)
    if st is not None:
        for name, obj in ((st.model_out, st.wrapped), (st.optimizer_out, st.optimizer)):
            if ns.get(name) is obj:
                del ns[name]
    del es, st
    gc.collect()
    del handle  # the last reference: ~ProcessGroupGloo joins its threads here, GIL released
    left = gloo_workers()
    if left:
        log.warning("%d gloo thread(s) still run after the job's group ended: something "
                    "outside dpnb (a group from new_group, a kept reference to the model) "
                    "holds a group, and the process may abort at exit", left)
