"""One ``train`` call on every rank: checked, stepped, checkpointed, summed up.

:func:`train` reads as its named steps: :func:`~dpnb.engine.train.trainplan.plan`
validates the call (no state changes; every rank raises the same one-line
error or none does), :func:`_checkpoint_dir`, :func:`_apply_lr_scale`, the
ranks align, :func:`_run_steps` (each step :meth:`~dpnb.engine.train.step._Loop.one_step`;
its stats all-gather finished one step later carries the stop flags), and
:func:`_summary` -- a :class:`~dpnb.core.events.TrainSummary`, rank 0's going
back to the notebook.
"""

from __future__ import annotations

import time

from dpnb.core.events import TrainSummary
from dpnb.core.trainargs import TrainArgs
from dpnb.engine.proc.process import scheduled_gc
from dpnb.engine.state import get_state
from dpnb.engine.train import peercopy
from dpnb.engine.train.dataset import current_data
from dpnb.engine.train.step import _Loop, _recorder_off_after
from dpnb.engine.train.stop import StopRequest, _make_publisher
from dpnb.engine.train.train_state import require_bound
from dpnb.engine.train.trainplan import Plan, plan

def train(ns: dict, args: TrainArgs) -> TrainSummary:
    """Run ``steps`` optimizer steps (or ``epochs`` passes) on every rank.

    Collective: all ranks must call it with the same arguments.  Each step
    reads ``grad_accum`` micro-batches of ``micro_batch`` samples from this
    rank's shard, so the global batch is ``micro_batch * world_size *
    grad_accum`` (checked every step from the gathered per-rank counts).

    Per micro-batch: forward, loss / grad_accum, backward; gradients are
    synchronized only in the last micro-batch's backward.  Then one optimizer
    step and ``zero_grad``.  The reported loss is the global mean over the
    global batch: each rank's mean over its micro-batches, averaged over the
    ranks by the one small per-step ``all_gather`` (a cheap extra collective
    that also carries the stop flag, compute time and sample count).

    ``lr_scale``: the optimizer's lr becomes ``base_lr * s`` with ``s`` =
    ``G/ref_batch`` (``linear``), ``sqrt(G/ref_batch)`` (``sqrt``) or 1
    (``none``); ``ref_batch`` defaults to ``micro_batch`` (what one process
    without accumulation would use).  ``base_lr`` is wrap's ``lr`` (or an lr
    you set on the optimizer, divided by the last scale applied).

    ``loss_fn(output, target)`` replaces the default criterion (MSE for float
    targets, cross-entropy for integer ids); ``step_fn(batch)`` (or
    ``step_fn(model, batch)``) replaces forward+loss entirely and must return
    the micro-batch's *mean* loss.  Either may be a function or its name in
    ``ns``.  Backward, gradient sync and the optimizer step stay here, so
    accumulation stays correct.

    Ctrl-C (SIGINT) or the Stop button (``EngineState.stop_requested`` or the
    file ``EngineState.stop_file``) stop all ranks together after the same
    step (the one after the request: the flags travel with a step's stats,
    which each rank reads after finishing the next step); model and optimizer
    keep their state.  ``EngineState.straggle_delay_s`` makes this rank sleep that long in each step.

    ``record`` (default: on, sampled) keeps DDP bucket/backward timelines and
    per-step byte counts: ``None`` keeps the timeline of the call's last step
    and of every ``RECORD_EVERY``-th step (the hooks cost a few percent of a
    short step), ``True`` of every step, ``False`` of none; step records (see
    :func:`records`) are always kept.  A step
    record holds ``step`` (global index, continuing across calls), ``epoch``,
    ``loss`` (global mean), ``loss_rank``, ``step_time_s``, ``samples`` =
    ``global_batch``, ``tokens`` (``seq_len`` per sample, from the argument or
    the dataset's ``seq_len``), ``micro_batch``, ``grad_accum``, ``dp``,
    ``lr``, ``samples_per_s``, ``tokens_per_s``, ``t_start``/``t_end``
    (``time.time``), ``straggle_delay_s``, ``bytes`` and ``counted_at_step``,
    ``compute_s`` / ``compute_s_all`` (what each means: :class:`StepRecord`).
    ``publish=True`` sends progress through ``ipyparallel.datapub`` (at most
    ~5 times a second); a callable receives the same dict.
    """
    es, st = get_state(ns), require_bound(ns)
    data = current_data(es, st)
    P = plan(ns, es, data, args)
    every = args.checkpoint_every
    ck_dir = _checkpoint_dir(st, args.checkpoint_dir, every)
    note = data.usage_note(P.micro_batch, P.grad_accum, P.world_size, P.n_steps)
    # Everything is validated: from here on the call changes state.
    lr_now = _apply_lr_scale(st, P)
    tps = args.seq_len if args.seq_len is not None else getattr(data.dataset, "seq_len", None)
    loop = _Loop(es, st, data, P, record=args.record, publisher=_make_publisher(args.publish),
                 tps=tps)
    st.module.train()
    loop.align()  # the ranks start the first step together
    first, t_call = st.step, time.perf_counter()
    saved = _run_steps(ns, loop, ck_dir, every)
    wall = time.perf_counter() - t_call
    return _summary(loop, first, wall, lr_now=lr_now, note=note, saved=saved, ck_dir=ck_dir)


def _checkpoint_dir(st, checkpoint_dir: str | None, every: int | None) -> str | None:
    """Where ``--checkpoint-every`` writes, checked before any step; None when off."""
    if every is None and checkpoint_dir is None:
        return None
    # lazy: autosave brings DCP (it loads FSDP); only --checkpoint-every pays
    from dpnb.engine.train import autosave

    return autosave.check(st, checkpoint_dir, every)


def _apply_lr_scale(st, P: Plan) -> float:
    """The optimizer's lr rescaled from the last call's scale to this one's; the lr now."""
    groups = st.optimizer.param_groups
    for g in groups:
        g["lr"] = float(g["lr"]) / st.lr_scale_applied * P.lr_scale
    st.lr_scale_applied = P.lr_scale
    return float(groups[0]["lr"])


def _run_steps(ns: dict, loop: _Loop, ck_dir: str | None, every: int | None) -> list:
    """The steps: each one's stats gather finished one step later (the stop flags
    travel with it), a checkpoint every ``every`` steps; the checkpoints written."""
    st, es = loop.st, loop.es
    pending, saved = None, []
    with StopRequest(es) as stop, _recorder_off_after(st.recorder), scheduled_gc(), \
            peercopy.Copier(ns) as peer:
        for i in range(loop.p.n_steps):
            issued = peer.after(loop.one_step(i, stop))  # every K steps: the peer copy
            if pending is not None and loop.finish(pending, stop):
                pending = issued
                break
            pending = issued
            if ck_dir is not None and st.step % every == 0:
                # lazy: autosave brings DCP (it loads FSDP); only --checkpoint-every pays
                from dpnb.engine.train import autosave

                stopping = loop.finish(pending, stop)  # the checkpoint holds finished steps
                pending = None
                saved.append(autosave.save_step(ns, ck_dir, st.step, loop.p.rank))
                if stopping:
                    break
        if pending is not None:
            loop.finish(pending, stop)
    return saved


def _summary(loop: _Loop, first: int, wall: float, *, lr_now: float, note, saved: list,
             ck_dir: str | None) -> TrainSummary:
    """What the call returns (rank 0's goes back to the notebook)."""
    st, P, tps = loop.st, loop.p, loop.tps
    done = st.step - first
    samples_total = done * P.global_batch
    return TrainSummary(
        rank=P.rank, strategy=st.strategy, steps=done, requested_steps=P.n_steps,
        first_step=first, last_step=st.step - 1 if done else None,
        interrupted=loop.stop_reason is not None, stop_reason=loop.stop_reason,
        loss=loop.losses[-1] if loop.losses else None, losses=loop.losses,
        global_batch=P.global_batch, micro_batch=P.micro_batch,
        grad_accum=P.grad_accum, dp=P.world_size, lr=lr_now, lr_scale=P.lr_mode,
        steps_per_epoch=P.steps_per_epoch, epoch=loop.data.epoch, time_s=wall,
        samples_per_s=samples_total / wall if wall > 0 else None,
        tokens_per_s=samples_total * tps / wall if (tps and wall > 0) else None,
        data_note=note, checkpoints=saved, checkpoint_dir=ck_dir,
    )
