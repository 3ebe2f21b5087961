"""Peer copies in CPU memory: what a sharded rank loses when its engine dies, kept by its neighbour.

Under ZeRO-1/2/3 no rank holds another's optimizer partition or parameter
shard, so a replica cannot rebuild a replaced rank (:mod:`.rebuild`).  Gemini
(SOSP '23) keeps checkpoints in peers' CPU memory instead; so does this
module, every ``K`` steps of ``train`` (``K`` = :data:`dpnb.core.peerplan.DEFAULT_EVERY` under the
sharded strategies, set with :func:`set_every`; off under DDP, whose replicas
need no copy):

1. after the step, each rank packs what it holds -- its parameters' local
   shards, buffers, its optimizer-state tensors, plus step, data position,
   learning-rate scale and loss scaler as JSON -- into one CPU byte buffer:
   its own *snapshot*.  Only this is on the step's path (the next step
   changes the tensors in place, so the copy to host memory is the
   consistent point);
2. a side thread sends the snapshot to the rank's *holder* -- ``r+1`` on one
   host; on several, a rank on another host
   (:func:`dpnb.core.peerplan.holders`) -- and receives the one it holds, as one ``all_to_all_single`` on a gloo
   group of its own (formed once per group generation, on every rank at the
   same copy point), so it never interleaves with the training's
   collectives on the default group; the training goes on meanwhile.  One
   copy is in flight at a time: the next copy point, a rebuild, ``info`` and
   a group's destruction wait for it (:meth:`PeerState.settle`);
3. in the same thread, one one-element ``all_reduce(MIN)`` on that group
   agrees every rank has both halves before any commits the pair (own
   snapshot, the copy it holds): a death during the copy fails the thread's
   collectives (the dead peer's connections close) and leaves every rank on
   the previous pair -- the half-received buffer is never committed.

On a death (:func:`dpnb.engine.train.rebuild.from_peers`) every rank rolls back to
its own snapshot and the replaced rank takes its buffer from its holder's copy;
two neighbours lost together take a shard and its only copy: the session
falls back to a disk checkpoint.  On a GPU the pack is a device-to-host copy
on the compute stream (synchronous; not measured here); the ring is on the
CPU, gloo, under NCCL too.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpnb import compat
from dpnb.core.peerplan import every_in_force, holders
from dpnb.core.strategies import is_fsdp
from dpnb.engine.state import get_state
from dpnb.engine.train.snapshot import restore_scalars, scalars_of
from dpnb.engine.train.train_state import TrainError

log = logging.getLogger(__name__)

#: where the copies' exchange keeps its tensors: their own group is gloo, under NCCL too
COPY_DEVICE = torch.device("cpu")


@dataclass
class PeerState:
    """One rank's committed pair and the exchange in flight (``EngineState.peer``)."""

    every: int | None = None  # None: the default (dpnb.core.peerplan.every_in_force)
    own: torch.Tensor | None = None  # this rank's snapshot (uint8, CPU)
    own_step: int | None = None
    copy: torch.Tensor | None = None  # the snapshot of the rank this one holds a copy of
    copy_of: int | None = None
    owner: int | None = None  # id() of the TrainState the pair was taken from
    sizes: tuple | None = None  # ((generation, owner), meta room, left's bytes): fixed per wrap
    group: tuple | None = None  # (generation, the copies' own gloo group, holder of each rank)
    thread: Any = None  # the side thread of the copy in flight
    wait: bool = False  # the step waits for its copy (synchronous, to measure the thread's gain)
    spare: tuple | None = None  # the pair the last commit replaced: the next copy's buffers
    # the step of the pair in ``spare`` while it is still that committed pair (None once
    # the next copy packs or receives into it): a rank killed as the agreement completes
    # leaves some survivors committed to the new pair and others on the old one, and the
    # newer ones go back to this (:func:`roll_back_pair`)
    spare_step: int | None = None
    cost: list | None = None  # [copies, seconds on the step's path, seconds in the side thread]

    def nbytes(self) -> int:
        """CPU bytes held: the committed pair and the spare one its next copy goes into."""
        return sum(t.numel() for t in (self.own, self.copy, *(self.spare or ())) if t is not None)

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the copy in flight (it commits or fails on its own: every
        rank's thread runs the same two collectives, and a dead peer's closed
        connections fail them)."""
        t = self.thread
        if t is None:
            return
        t.join(timeout)
        if t.is_alive():  # a peer alive but never at this copy point: the group timeout ends it
            log.warning("the peer copy in flight did not finish in %s s; left to fail", timeout)
        else:
            self.thread = None

    def drop(self) -> None:
        """Forget the pair: copies off, or taken from another wrap (a rollback to
        them would go back to another model, or behind a fresher checkpoint)."""
        self.settle()
        self.own = self.own_step = self.copy = self.copy_of = self.owner = self.spare = None
        self.spare_step = None


def host_name() -> str:
    """This rank's host, as the holders' placement compares them."""
    return socket.gethostname()


def peer_state(es) -> PeerState:
    if es.peer is None:
        es.peer = PeerState()
    return es.peer


def every_for(es, st) -> int:
    """The copy interval in force for this wrap (0: off)."""
    return every_in_force(peer_state(es).every, st.strategy)


def set_every(ns: dict, every: int, wait: bool = False) -> dict:
    """Copy every ``every`` steps (0: never); ``wait``: the step waits for the
    copy to arrive (the synchronous copy, for benchmarks/peercopy.py).  Local;
    call it on every rank alike."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise TrainError(f"the peer-copy interval must be a whole number of steps >= 0 (got {every!r})")
    ps = peer_state(get_state(ns))
    ps.every, ps.wait, ps.cost = every, bool(wait), [0, 0.0, 0.0]
    if not every:
        ps.drop()
    return {"every": every}


def _inner(st):
    return compat.zero_inner_optimizer(st.optimizer) if st.strategy == "zero1" else st.optimizer


def local_tensors(st) -> list:
    """What this rank alone may hold, in an order every rebuild of it repeats."""
    ts = [compat.local_tensor(t) for t in list(st.module.parameters()) + list(st.module.buffers())]
    opt = _inner(st)
    for g in opt.param_groups:
        for p in g["params"]:
            s = opt.state.get(p, {})
            ts += [compat.local_tensor(s[k]) for k in sorted(s) if isinstance(s[k], torch.Tensor)]
    return ts


def pack(st, cap: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[meta length][meta JSON][every local tensor's bytes]`` in one CPU uint8 buffer;
    with ``cap`` the JSON is padded to ``cap`` bytes, so the buffer's size stays
    fixed from copy to copy (the step and the data position grow digits), and
    ``out`` of that size is reused (a fresh 9 MB buffer cost 3 ms more here:
    its pages are touched for the first time)."""
    ts = local_tensors(st)
    meta = json.dumps({
        **scalars_of(st), "strategy": st.strategy,
        "layout": [[list(t.shape), str(t.dtype).split(".")[-1]] for t in ts],
    }).encode()
    if cap is not None:
        if len(meta) > cap:
            raise TrainError(f"the peer copy's description grew past {cap} bytes: re-wrap")
        meta += b" " * (cap - len(meta))  # JSON ignores trailing blanks
    parts = [torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8),
             torch.frombuffer(bytearray(meta), dtype=torch.uint8)]
    parts += [t.detach().reshape(-1).view(torch.uint8).cpu() for t in ts]
    if out is not None and out.numel() == sum(t.numel() for t in parts):
        return torch.cat(parts, out=out)
    return torch.cat(parts)


def meta_of(buf: torch.Tensor) -> tuple[dict, int]:
    n = int(buf[:8].view(torch.int64)[0])
    return json.loads(bytes(buf[8:8 + n].tolist()).decode()), 8 + n


def unpack_into(st, buf: torch.Tensor) -> dict:
    """Copy a :func:`pack` buffer back into ``st``'s tensors (same layout), and its meta."""
    meta, off = meta_of(buf)
    ts = local_tensors(st)
    if [[list(t.shape), str(t.dtype).split(".")[-1]] for t in ts] != meta["layout"]:
        raise TrainError("the peer copy's tensors do not match this rank's model: the replayed "
                         "cells built another model or optimizer")
    with torch.no_grad():
        for t in ts:
            nb = t.numel() * t.element_size()
            t.copy_(buf[off:off + nb].clone().view(t.dtype).view(t.shape))
            off += nb
    restore_scalars(st, meta)  # a dataset of another length keeps its own position
    return meta


def ring(es, send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group=None) -> None:
    """``send`` to rank ``to``, ``recv`` filled from rank ``frm``, as one
    ``all_to_all_single`` whose other splits are empty.  A collective, not
    gloo's send/recv: point-to-point receives left posted when a peer died
    aborted the survivor (SIGABRT), where a collective fails with an error."""
    ins, outs = [0] * es.world_size, [0] * es.world_size
    ins[to], outs[frm] = send.numel(), recv.numel()
    dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins, group=group)


class Copier:
    """The train loop's peer copies: ``after(issued)`` once per step (it hands
    ``issued`` back, so the loop calls it in the same line).  A copy still in
    flight when the call ends goes on in its thread; when the call failed
    (a peer may have died) it is waited for here, before the session looks
    at the pairs or a re-formation destroys the group under it."""

    def __init__(self, ns: dict):
        self.es = get_state(ns)
        self.st = self.es.train
        self.ps = peer_state(self.es)
        self.every = every_for(self.es, self.st) if self.es.world_size > 1 else 0
        self.cdev = self.es.comm_device
        if not self.every or self.ps.owner != id(self.st):
            self.ps.drop()

    def __enter__(self) -> "Copier":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.ps.settle(self.es.timeout_s)

    def after(self, issued):
        if self.every and self.st.step % self.every == 0:
            t0 = time.perf_counter()
            self.ps.settle()  # one copy in flight at a time (at K=1 it overlaps one step)
            own, pg, nbytes = self._snapshot()
            left = self.ps.group[2].index(self.es.rank)  # the rank whose copy this one keeps
            t = threading.Thread(target=self._send, args=(own, pg, nbytes, self.st.step, left),
                                 name="dpnb-peer-copy", daemon=True)
            self.ps.thread = t
            t.start()
            if self.ps.wait:
                self.ps.settle()
            if self.ps.cost is not None:  # what the step waited for (benchmarks/peercopy.py)
                self.ps.cost[0] += 1
                self.ps.cost[1] += time.perf_counter() - t0
        return issued

    def _group(self):
        """The copies' own gloo group and who holds whose copy, formed once per
        group generation (collective: every rank reaches its first copy point
        alike): the ranks' hosts go round on the new group, and each rank's
        holder is on another host where there are several (:func:`holders`)."""
        gen = self.es.generation
        if self.ps.group is None or self.ps.group[0] != gen:
            pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.es.timeout_s))
            hosts: list = [None] * self.es.world_size
            dist.all_gather_object(hosts, host_name(), group=pg)
            self.ps.group = (gen, pg, holders(hosts))
        return self.ps.group[1]

    def _snapshot(self) -> tuple:
        """This rank's packed state (main thread: the consistent point), the
        copies' group and the size of the buffer this rank holds a copy of."""
        ps = self.ps
        key = (self.es.generation, id(self.st))
        pg = self._group()
        if ps.sizes is None or ps.sizes[0] != key:
            # once a wrap and group, on every rank alike (a new wrap or a
            # re-formed group changes the key everywhere; a replaced rank's
            # fresh state alone would not): the sizes go round first (the
            # receiver allocates), the description's room fixed with slack
            cap = 2 * meta_of(pack(self.st))[1] + 4096
            own = pack(self.st, cap)
            n = torch.tensor([own.numel()], dtype=torch.int64, device=self.cdev)
            m = torch.empty(self.es.world_size, dtype=torch.int64, device=self.cdev)
            dist.all_gather_into_tensor(m, n)
            ps.sizes = (key, cap, int(m[ps.group[2].index(self.es.rank)]))
        else:  # into the buffer the last commit freed, while no thread uses it
            ps.spare_step = None  # the old pair's buffers are this copy's from here on
            own = pack(self.st, ps.sizes[1], out=ps.spare[0] if ps.spare else None)
        return own, pg, ps.sizes[2]

    def _send(self, own: torch.Tensor, pg, nbytes: int, step: int, left: int) -> None:
        """The side thread: the ring, the agreement, the commit -- or nothing
        committed, the previous pair kept, when a collective fails."""
        t0 = time.perf_counter()
        spare = self.ps.spare
        try:
            recv = (spare[1] if spare and spare[1].numel() == nbytes
                    else torch.empty(nbytes, dtype=torch.uint8, device=COPY_DEVICE))
            ring(self.es, own, recv, self.ps.group[2][self.es.rank], left, group=pg)
            ok = torch.ones(1, device=COPY_DEVICE)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)  # every rank has both halves
        except Exception as e:  # a peer died or the group was released: keep the last pair
            log.info("peer copy of step %d not committed (the previous pair stays): %s: %s",
                     step, type(e).__name__, e)
            return
        ps = self.ps
        if ps.own is not None and ps.copy is not None:
            ps.spare, ps.spare_step = (ps.own, ps.copy), ps.own_step
        ps.own, ps.own_step, ps.owner, ps.copy, ps.copy_of = own, step, id(self.st), recv, left
        if ps.cost is not None:
            ps.cost[2] += time.perf_counter() - t0


def info(ns: dict) -> dict:
    """This rank's committed pair, for the session's choice.  Local."""
    es = get_state(ns)
    ps = peer_state(es)
    ps.settle(es.timeout_s)
    copy_step = meta_of(ps.copy)[0]["step"] if ps.copy is not None else None
    return {"own_step": ps.own_step, "copy_of": ps.copy_of, "copy_step": copy_step,
            "spare_step": ps.spare_step,
            "holders": ps.group[2] if ps.group else None,
            "bytes": ps.nbytes(), "every": every_for(es, es.train) if es.train else None,
            "fsdp": bool(es.train and is_fsdp(es.train.strategy)),
            "cost": list(ps.cost) if ps.cost else None}


def roll_back_pair(ns: dict, step: int) -> dict:
    """Make the pair of ``step`` this rank's committed one again, if it is the one the
    last commit kept (``spare``): the session's word after a death left the survivors
    one copy apart.  Local; its answer is :func:`info`'s."""
    es = get_state(ns)
    ps = peer_state(es)
    ps.settle(es.timeout_s)
    if ps.own_step != step:
        if ps.spare_step != step or ps.spare is None:
            raise TrainError(f"rank {es.rank} keeps no peer-copy pair of step {step} "
                             f"(its pair is of step {ps.own_step})")
        (ps.own, ps.copy), ps.own_step = ps.spare, step
        ps.spare = ps.spare_step = None  # the newer pair is dropped: the ranks agree on this one
    return info(ns)
