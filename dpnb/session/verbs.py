"""Notebook side of training: wrap, data, train with live progress, check,
checkpoints.  Each function calls the engine-side function of the same name
in :mod:`dpnb.engine.train.training` / :mod:`dpnb.engine.train.check` /
:mod:`dpnb.engine.train.checkpoint` on every rank at once (they are collectives),
and turns the per-rank answers into one result.  The same functions back the
``%dp wrap / data / train / check / save / load / pull-model`` magics and the
``Cluster.wrap`` ... methods; what the next action needs to know of them goes
to the session's :class:`~dpnb.session.training_state.TrainingState`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..ippcompat import result_metadata
from ..core.events import ProgressEvent, TrainSummary
from ..core.errors import ConfigError
from ..core.labviews import memory_panel, sync_panel
from ..core.trainargs import TrainArgs
from ..core.strategies import STRATEGIES, is_fsdp, parse_comm_hook
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from ..progress import TrainProgress
from ..ranks import rank_label
from .record import DataStep, LoadStep, WatchStep, WrapStep
from .results import TrainResult
from .training_state import LastTrain, TrainCall, WrapRecord

log = logging.getLogger(__name__)



def _rank0(res) -> Any:
    return res.values[0]


def _build(cluster, step):
    """Send a setup step's call to every rank; once it succeeded, it is a step of the
    session's setup record (what resume replays and export writes)."""
    dotted, args, kw = step.call()
    res = cluster.call(dotted, *args, **kw)
    cluster.setup_log.add(step)
    return res


def wrap(cluster, model: str = "model", strategy: str = "ddp", **opts) -> dict:
    """Wrap the module named ``model`` on every rank with ``strategy``.

    ``strategy``: ``ddp`` | ``zero1`` (DDP + ZeroRedundancyOptimizer) |
    ``zero2`` / ``zero3`` (FSDP2 ``fully_shard`` without / with resharding
    after forward).  Options go to :func:`dpnb.engine.train.training.wrap`
    (``bucket_cap_mb``, ``mixed_precision``, ``cpu_offload``, ``wrap_classes``,
    ``optimizer``, ``lr``, ``weight_decay``, ``momentum``, ...).
    """
    if strategy not in STRATEGIES:
        raise DpnbError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    hook = opts.get("comm_hook")
    if hook is not None:
        try:
            kind, _ = parse_comm_hook(hook)
        except ConfigError as e:
            raise DpnbError(str(e)) from None
        if kind != "none" and is_fsdp(strategy):
            raise DpnbError(f"--comm-hook {hook} compresses DDP's gradient buckets (ddp, zero1); "
                            f"{strategy} has none: use --mixed-precision bf16 to halve its bytes")
    if is_fsdp(strategy) and opts.get("mixed_precision") == "fp16" and cluster.backend == "gloo":
        raise DpnbError("fp16 mixed precision with FSDP needs GPUs (NCCL); on a CPU cluster "
                        "use --mixed-precision bf16 or none")
    missing = cluster.call(ep.HAS_NAMES, [model])
    lacking = [r for r, v in zip(missing.ranks, missing.values) if v]
    if lacking:
        raise DpnbError(f"there is no {model!r} on {rank_label(lacking)}: build the model in a "
                        f"%%dp cell on every rank first (e.g. {model} = torch.nn.Linear(8, 1))")
    step = WrapStep(model, strategy, dict(opts))
    info = _rank0(_build(cluster, step))
    cluster.training.wrapped(WrapRecord(step, info))
    # Timing hooks for the gradient-sync view (optimizer step, FSDP
    # all-gather / reduce-scatter); local to each rank, no communication.
    _build(cluster, WatchStep())
    return info


def set_data(cluster, dataset: str, *, seed: int = 0, shuffle: bool = True) -> dict:
    """Use the dataset named ``dataset`` (defined on every rank) for training."""
    return _rank0(_build(cluster, DataStep(dataset, seed=seed, shuffle=shuffle)))


def train(cluster, args: TrainArgs) -> TrainResult | None:
    """Run training steps on every rank with a live progress display.

    ``args`` is the call's one typed contract (:class:`dpnb.core.trainargs.TrainArgs`):
    the batch layout is filled in here (from ``%dp resize``'s plan, else the
    defaults), the whole call checked once, then sent as that one object to
    every rank (``ep.TRAIN``).

    Ctrl-C (Jupyter's "interrupt kernel") stops every rank together after the
    same step (at most one step after the one that was running: the ranks
    agree through each step's stats, read one step later); the model and
    optimizer keep their state and a later ``train`` continues from the next
    step.

    ``args.peer_copy_every``: the peer copies' interval K (``0`` / ``"off"``: none),
    kept for the session's later calls and set on every rank before each
    call, so a replaced rank copies at the same steps as the survivors.
    """
    if args.steps is None and args.epochs is None:  # before the layout's defaults are chosen
        raise DpnbError("say how long to train: --steps S or --epochs E")
    micro_batch, grad_accum, from_plan = batch_layout(cluster, args.micro_batch, args.grad_accum)
    args = TrainArgs.checked(**{**args.as_dict(), "micro_batch": micro_batch,
                                "grad_accum": grad_accum})
    st = cluster.training
    if args.peer_copy_every is not None:
        st.peer_copy_every = args.peer_copy_every
    if st.peer_copy_every is not None:  # every rank alike, a replaced one included
        cluster.call(ep.PEER_SET_EVERY, st.peer_copy_every)
    if args.checkpoint_dir is not None:  # restart --resume finds it even if this run dies
        st.autosave_dir = args.checkpoint_dir
    view = TrainProgress(args.steps, kernel=None) if args.publish else None
    sent: dict = {}

    def on_poll(ars: dict) -> None:
        sent.update(ars)
        # rank 0's latest datapub payload, kept by the client's I/O thread
        ev = ProgressEvent.decode(result_metadata(ars[min(ars)]).get("data"))
        if ev is not None:
            cluster.progress_feed.publish(ev)

    # the live view hears this call's events; the session's other subscribers stay
    unsubscribe = (cluster.subscribe(view.update) if view is not None else lambda: None)
    try:
        res = cluster.call(ep.TRAIN, args, timeout=args.timeout, on_poll=on_poll,
                           raise_errors=False)
    finally:
        unsubscribe()
    summary: TrainSummary | None = res.values[0] if res.ok else None
    if summary:
        cluster.published.progress(summary.progress_event().as_dict())
    note = ""
    if summary and summary.interrupted:
        note = (f"stopped at step {summary.last_step} "
                f"({summary.stop_reason}); model and optimizer state kept")
    if view is not None:
        view.close(summary, note=note)
    if not res.ok:
        raise res.error
    # Each rank's last progress payload: the dashboard shows the run's end
    # from it, however its poller's ticks fell.
    finals = {}
    for ar in sent.values():
        ev = ProgressEvent.decode(result_metadata(ar).get("data"))
        if ev is not None:
            finals[ev.rank] = ev.as_dict()
    st.last_train = LastTrain(args, summary, finals)
    publish_step_views(cluster)
    if summary and summary.steps:
        st.train_log.append(TrainCall.of(summary.steps, cluster.world_size, args))
    if summary is None:
        return None
    if not from_plan:  # a layout of the user's own: the resize plan is history
        st.batch_plan = None
    return TrainResult.of(summary, batch_note=from_plan)


def publish_step_views(cluster) -> None:
    """JupyterLab's gradient-sync and memory panels: after a train call, one engine
    call (no collective) brings each rank's last recorded step and model-state bytes,
    and the runtime's publication carries them to the Jupyter server.  A failure
    here is logged and costs the panels, never the training."""
    pub = cluster.published
    if pub is None:
        return
    try:
        per = cluster.call(ep.STEP_VIEWS).values
        recs = [r for v in per for r in v["gradsync"]]
        snaps = [v["memory"] for v in per if v["memory"] is not None]
        sync = sync_panel(recs, cluster.world_size) if recs else None
        memory = memory_panel(snaps) if len(snaps) == cluster.world_size else None
    except Exception as e:  # the panels are a view: training's result stands
        log.warning("the step's views for JupyterLab were not read: %s: %s", type(e).__name__, e)
        return
    pub.step_views(sync, memory)


#: what ``train`` uses when neither the call nor a resize says
DEFAULT_MICRO_BATCH, DEFAULT_GRAD_ACCUM = 8, 1


def batch_layout(cluster, micro_batch: int | None, grad_accum: int | None) -> tuple:
    """``(micro_batch, grad_accum, note)`` for a train call.

    Values given win.  Left out, they come from the plan ``%dp resize`` made
    (the global batch kept on the new number of ranks; the grad-accum only
    while the micro-batch is the plan's), else from the defaults.
    """
    p = cluster.training.batch_plan
    note = ""
    if micro_batch is None:
        micro_batch = p.micro_batch if p else DEFAULT_MICRO_BATCH
    if grad_accum is None:
        if p and micro_batch == p.micro_batch:
            grad_accum = p.grad_accum
            note = (f"micro-batch {micro_batch} x grad-accum {grad_accum} from %dp resize "
                    f"(global batch {p.global_batch} kept)")
        else:
            grad_accum = DEFAULT_GRAD_ACCUM
    return micro_batch, grad_accum, note


def check(cluster, model: str | None = None) -> dict:
    """Are the replicas in sync?  Rank 0's verdict, naming differing tensors."""
    return _rank0(cluster.call(ep.CHECK, model_name=model))


def save(cluster, path: str) -> dict:
    """Save model + optimizer + step with torch.distributed.checkpoint."""
    return _rank0(cluster.call(ep.SAVE, os.path.abspath(path)))


def load(cluster, path: str) -> dict:
    """Load a checkpoint saved under any strategy / world size (no unpickling)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise DpnbError(f"no checkpoint folder at {path}: give the folder %dp save wrote")
    info = _rank0(cluster.call(ep.LOAD, path))
    loaded(cluster, path, info)
    return info


def loaded(cluster, path: str, info: dict) -> None:
    """Every rank now holds ``path``'s state: the record says so (a
    :class:`LoadStep`), and the train calls count again from its step."""
    cluster.setup_log.add(LoadStep(path, int(info.get("step") or 0)))
    cluster.training.loaded()


def pull_model(cluster) -> dict:
    """The full, unwrapped state dict (gathered for FSDP), from rank 0."""
    return _rank0(cluster.call(ep.FULL_STATE_DICT))


def records(cluster, last: int | None = None) -> list[list[dict]]:
    """Per-rank step records: ``records[rank][i]``."""
    return cluster.call(ep.RECORDS, last=last).values
