"""The training step on every rank: micro-batches, backward, gradient sync, optimizer, record.

Gradient accumulation: with ``grad_accum=K`` a step runs ``K`` micro-batches;
gradient synchronization happens only in the backward of the last one
(``no_sync()`` for DDP, ``set_requires_gradient_sync(False)`` for FSDP2),
each micro-batch loss is divided by ``K``, and since DDP/FSDP average over the
``N`` ranks the resulting gradient is that of the mean loss over the global
batch of ``micro_batch * N * K`` samples -- the same gradient one process
would get from that whole batch.

Per step, besides the gradient collectives, the loop issues exactly one small
extra collective: an asynchronous ``all_gather`` of ``[loss, stop flag,
compute seconds, samples]`` from every rank, read after the *next* step.  It
gives the global mean loss, makes all ranks stop at the same step boundary
after Ctrl-C / Stop, feeds the straggler view and checks the global batch
size (the per-rank sample counts must add up to it).

One step, torchtitan-style, as named parts (:meth:`_Loop.one_step`):
:meth:`_Loop.micro_batches` forward/backward, :meth:`_Loop.optimizer_step`,
:meth:`_Loop.issue_stats` starts the gather; :meth:`_Loop.finish` completes a
step's record and progress one step later.  A whole call -- the plan, the
steps, checkpoints, the summary -- is :mod:`dpnb.engine.train.call`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import deque

import torch
import torch.distributed as dist

from dpnb import compat
from dpnb.core.events import ProgressEvent
from dpnb.core.strategies import is_fsdp
from dpnb.engine import device
from dpnb.engine.train.microbatch import _split, _to_device, default_loss
from dpnb.engine.proc.process import GC_EVERY
from dpnb.engine.train.measure import state_bytes
from dpnb.engine.train.trainplan import Plan
from dpnb.engine.train.train_state import (BYTES_EVERY, StepRecord, TrainError, records_buckets)

log = logging.getLogger(__name__)


def optimizer_gate(es, since: int, dev) -> None:
    """Refuse the optimizer step if the group was released or aborted during this step.

    Under gloo a release makes the gradient all-reduce raise, so the step is
    never reached.  Under NCCL the all-reduce only *queues* a kernel: the
    optimizer's kernels are queued behind it, and an abort makes that kernel
    exit early -- the optimizer would apply partly reduced gradients and
    nothing would say so.  Two things abort it: dpnb's release (counted in
    ``es.releases``) and torch's watchdog, when a collective outlives the
    group timeout (a rank stalled that long) or fails; it records that on
    the group (:func:`dpnb.compat.group_error`).  So: wait for the device's
    queued work, then check both -- after the wait, since either may land
    during it.  Only NCCL needs the wait (a per-step host stall): elsewhere
    a released all-reduce raises before the optimizer is reached.
    """
    nccl = getattr(es, "backend", None) == "nccl"
    if nccl:
        device.synchronize(dev)
    if es.releases != since:
        raise TrainError("the process group was released during this step's gradient sync: "
                         "its optimizer step was not applied (the gradients may be only partly "
                         "reduced), so the weights are those before the step")
    err = compat.group_error() if nccl else None
    if err is not None:
        raise TrainError(f"torch's NCCL watchdog aborted the process group ({err}): this "
                         "step's optimizer step was not applied (the gradients may be only "
                         "partly reduced); re-form the group (%dp reform) to go on")


#: values each rank contributes to a step's stats gather: loss, stop flag, compute s, samples
STATS = 4


@contextlib.contextmanager
def _recorder_off_after(rec):
    """Outside ``train`` the recorder's hooks are off (a cell's own backward
    on the wrapped model pays nothing for them)."""
    try:
        yield
    finally:
        if rec is not None:
            rec.set_enabled(False)


class _Loop:
    """One ``train`` call's running state on this rank."""

    def __init__(self, es, st, data, p: Plan, *, record: bool | None, publisher, tps):
        self.es, self.st, self.data, self.p = es, st, data, p
        # record=None: byte counts as the default says, bucket timelines sampled
        self.record_arg = record
        self.record = st.record_default if record is None else bool(record)
        # Progress is the same on every rank (global loss, every rank's compute
        # time, all ranks finish a step together): rank 0 alone publishes it,
        # so N ranks do not send N messages through the controller 5 times a second.
        self.publisher = publisher if p.rank == 0 else None
        self.tps = tps
        self.dev = st.device
        self.cdev = es.comm_device
        self.fsdp = is_fsdp(st.strategy)
        mp = st.config["mixed_precision"]
        self.autocast = (torch.autocast(self.dev.type, dtype=torch.bfloat16 if mp == "bf16"
                                        else torch.float16)
                         if mp != "none" and not self.fsdp else None)
        self.rec = st.recorder
        self.losses: list = []
        self.stop_reason: str | None = None
        # the first publish waits as long as later ones: a call shorter than
        # that sends only its last step
        self.last_pub = time.perf_counter()
        # Every publish carries the recent history, not just what is new since
        # the last one: the notebook only sees the latest published dict, and
        # it polls less often than steps may finish.
        self.pub_hist: deque = deque(maxlen=500)
        self.counted = None  # the last state_bytes count, carried to the steps in between

    def align(self) -> None:
        """Start the first step together: the engines receive the call at
        slightly different moments, and without this the first step's gradient
        sync would absorb that skew and report it as step time (and as waiting,
        to the straggler view).  One tiny all-reduce, read back on the host."""
        t = torch.zeros(1, device=self.cdev)
        dist.all_reduce(t)
        t.item()  # under NCCL the all-reduce is only queued: wait for it here

    def micro_batches(self) -> tuple[torch.Tensor, float, int, float]:
        """Forward and backward of the step's ``K`` micro-batches; gradients
        sync in the last backward.  Returns (mean loss, compute s, samples, delay)."""
        p, st, rec = self.p, self.st, self.rec
        model = st.wrapped
        compute, n_local = 0.0, 0
        loss_acc = None
        delay = float(self.es.straggle_delay_s or 0.0)
        for k in range(p.grad_accum):
            last = k == p.grad_accum - 1
            batch, n = self.data.micro_batch(k, p.micro_batch, p.rank, p.world_size)
            n_local += n
            batch = _to_device(batch, self.dev)
            tc = time.perf_counter()
            if last and delay > 0:
                time.sleep(delay)  # a simulated slow rank: others wait in the sync
            if rec is not None:
                rec.micro = k
            if self.fsdp:
                model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if (last or self.fsdp) else model.no_sync()
            with sync:
                loss = self._forward(model, batch)
                # one micro-batch: the loss as it is (no view, no division: on a
                # GPU each op is a host-side launch, and these steps are
                # host-bound); backward takes any one-element loss
                scaled = loss.reshape(()) / p.grad_accum if p.grad_accum > 1 else loss
                if st.scaler is not None:
                    scaled = st.scaler.scale(scaled)
                if last:
                    compute += time.perf_counter() - tc
                    if rec is not None:
                        rec.arm()
                    scaled.backward()
                    if rec is not None:
                        rec.disarm()
                else:
                    scaled.backward()
                    compute += time.perf_counter() - tc
            part = loss.detach().reshape(())
            if p.grad_accum > 1:  # summed in float64 over the micro-batches
                part = part.double()
                loss_acc = part if loss_acc is None else loss_acc + part
            else:
                loss_acc = part
        # one micro-batch's loss goes as it is: issue_stats copies it into the
        # float64 stats, the same value without a kernel launched for it
        mean = loss_acc / p.grad_accum if p.grad_accum > 1 else loss_acc
        return mean, compute, n_local, delay

    def _forward(self, model, batch) -> torch.Tensor:
        p = self.p
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            if p.step_fn is not None:
                loss = p.step_fn(model, batch) if p.step_arity >= 2 else p.step_fn(batch)
            else:
                x, y = _split(batch)
                loss = (p.loss_fn or default_loss)(model(x), y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TrainError(
                "the loss must be a scalar tensor (the micro-batch mean), got "
                f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
            )
        return loss

    def optimizer_step(self, step_idx: int, since: int,
                       counting: bool) -> tuple[dict | None, float]:
        """Step, count the bytes (when recording), zero the gradients.
        ``since``: the process's release count when the step began;
        ``counting``: this step counts its bytes (:meth:`counts_bytes`)."""
        st, dev = self.st, self.dev
        tc = time.perf_counter()
        optimizer_gate(self.es, since, dev)
        if st.scaler is not None:
            st.scaler.step(st.optimizer)
            st.scaler.update()
        else:
            st.optimizer.step()
        nbytes = None
        if counting:
            self.counted = dict(state_bytes(st.module, st.optimizer, dev),
                                counted_at_step=step_idx)
            nbytes = self.counted
        elif self.record:
            # Carried, allocator readings included: each reading builds the
            # allocator's whole stats dict (75-80 us on an H200 host, two per
            # step were 7 % of a 4 ms step)
            nbytes = dict(self.counted)
        st.optimizer.zero_grad(set_to_none=True)
        return nbytes, time.perf_counter() - tc

    def counts_bytes(self, i: int) -> bool:
        """Whether step ``i`` of this call counts its state bytes and reads the
        allocator (its peak since the step began): the first and last step of
        a call and every ``BYTES_EVERY``-th; the others carry that count."""
        return self.record and (self.counted is None or i == self.p.n_steps - 1
                                or i % BYTES_EVERY == 0)

    def issue_stats(self, loss, compute: float, n_local: int, stop_local) -> tuple:
        """Start the step's ``all_gather`` of [loss, stop, compute, samples].

        Waited for after the *next* step: by then every rank has long sent its
        part (they all passed through that step's gradient sync), so the wait
        is free.  A blocking all_gather here would add a barrier per step, and
        on a busy machine every barrier costs the ranks' jitter (measured:
        +3-5 ms per 25 ms step on 2 CPU ranks).
        """
        cdev = self.cdev
        # One tensor in, one flat tensor out (rank r's four values at 4r..4r+3):
        # a list of per-rank outputs cost twice the Python per step.
        stats = torch.tensor([0.0, 1.0 if stop_local else 0.0, compute, float(n_local)],
                             dtype=torch.float64, device=cdev)
        stats[0].copy_(loss)
        gathered = torch.empty(STATS * self.p.world_size, dtype=torch.float64, device=cdev)
        return dist.all_gather_single(gathered, stats, async_op=True), gathered

    def finish(self, p: dict, stop) -> bool:
        """Complete step ``p``: wait for its gathered stats, check the global
        batch, keep its record, publish progress.  True when a rank asked to
        stop (every rank sees the same flags here, so all stop after the same
        step)."""
        P = self.p
        G = P.global_batch
        p["work"].wait()
        flat = p["gathered"].tolist()  # one device-to-host read for the four values of every rank
        loss_r, stop_r, compute_r, samples_r = (flat[k::STATS] for k in range(STATS))
        n_global = int(sum(samples_r))
        if n_global != G:
            raise TrainError(
                f"global batch check failed at step {p['step']}: ranks processed "
                f"{samples_r} samples = {n_global}, expected micro_batch x "
                f"world_size x grad_accum = {P.micro_batch} x {P.world_size} x "
                f"{P.grad_accum} = {G}"
            )
        gloss = sum(loss_r) / len(loss_r)
        dt, tps = p["dt"], self.tps
        rec = StepRecord(
            step=p["step"], epoch=p["epoch"], rank=P.rank, loss=gloss,
            loss_rank=loss_r[P.rank], step_time_s=dt, samples=G,
            tokens=G * tps if tps else None, global_batch=G, micro_batch=P.micro_batch,
            grad_accum=P.grad_accum, dp=P.world_size, lr=p["lr"], compute_s=p["compute"],
            compute_s_all=compute_r, straggle_delay_s=p["delay"],
            samples_per_s=G / dt if dt > 0 else None,
            tokens_per_s=G * tps / dt if (tps and dt > 0) else None,
            t_start=p["wall0"], t_end=p["t_end"], strategy=self.st.strategy, bytes=p["bytes"],
        )
        self.st.records.append(rec)
        self.losses.append(gloss)
        stopping = max(stop_r) > 0
        self._publish(rec, p["i"], stopping)
        if stopping and self.stop_reason is None:
            self.stop_reason = p["stop_local"] or stop.reason() or "stopped_by_other_rank"
        return stopping

    def _publish(self, rec: StepRecord, i: int, stopping: bool) -> None:
        """Progress through ipyparallel's datapub, at most ~5 times a second."""
        if self.publisher is None:
            return
        self.pub_hist.append((rec.step, rec.loss, rec.samples_per_s))
        now = time.perf_counter()
        if not (now - self.last_pub >= 0.2 or i == self.p.n_steps - 1 or stopping):
            return
        payload = ProgressEvent(
            rank=rec.rank, step=rec.step, done=i + 1, total=self.p.n_steps, loss=rec.loss,
            samples_per_s=rec.samples_per_s, tokens_per_s=rec.tokens_per_s,
            step_time_s=rec.step_time_s, compute_s_all=rec.compute_s_all,
            history=list(self.pub_hist)).encode()
        try:
            self.publisher(payload)
        except Exception as e:  # not inside an engine after all; keep training
            log.info("publishing progress failed (%s: %s): progress off for this call",
                     type(e).__name__, e)
            self.publisher = None
        self.last_pub = now

    def one_step(self, i: int, stop) -> dict:
        """Run step ``i`` of this call up to issuing its stats gather."""
        st, data, P = self.st, self.data, self.p
        data.ensure_room(P.micro_batch * P.grad_accum, P.rank, P.world_size)
        step_idx = st.step
        counting = self.counts_bytes(i)
        if counting:
            device.reset_peak_memory(self.dev)
        wall0 = time.time()
        t0 = time.perf_counter()
        if self.rec is not None:
            # per-parameter hooks only on the steps whose timeline is kept
            self.rec.set_enabled(records_buckets(self.record_arg, self.st.record_default, i,
                                                 P.n_steps, step_idx))
            self.rec.begin_step(step_idx, origin=wall0)
        since = self.es.releases
        loss, compute, n_local, delay = self.micro_batches()
        nbytes, opt_s = self.optimizer_step(step_idx, since, counting)
        compute += opt_s
        stop_local = stop.reason()
        work, gathered = self.issue_stats(loss, compute, n_local, stop_local)
        if (step_idx + 1) % GC_EVERY == 0:
            gc.collect(1)  # counted in this step's time: it is the loop's cost
        # the step's kernels, not just their launches, belong in its time
        device.synchronize(self.dev)
        t1 = time.perf_counter()
        if self.rec is not None:
            self.rec.end_step()
        issued = {
            "work": work, "gathered": gathered, "step": step_idx, "epoch": data.epoch,
            "dt": t1 - t0, "wall0": wall0, "t_end": time.time(), "compute": compute,
            "delay": delay, "bytes": nbytes, "lr": float(st.optimizer.param_groups[0]["lr"]),
            "i": i, "stop_local": stop_local,
        }
        data.offset += P.global_batch
        st.step += 1
        return issued
