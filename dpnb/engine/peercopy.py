"""Peer copies in CPU memory: what a sharded rank loses when its engine dies, kept by its neighbour.

Under ZeRO-1/2/3 no rank holds another's optimizer partition or parameter
shard, so a replica cannot rebuild a replaced rank (:mod:`.rebuild`).  Gemini
(SOSP '23) keeps checkpoints in peers' CPU memory instead; so does this
module, every ``K`` steps of ``train`` (``K`` = :data:`DEFAULT_EVERY` under the
sharded strategies, set with :func:`set_every`; off under DDP, whose replicas
need no copy):

1. after the step, each rank packs what it holds -- its parameters' local
   shards, buffers, its optimizer-state tensors, plus step, data position,
   learning-rate scale and loss scaler as JSON -- into one CPU byte buffer:
   its own *snapshot* (a host copy, on the step's path: the next step changes
   the tensors in place);
2. the snapshot goes round the ring: rank ``r`` sends it to ``r+1`` and
   receives ``r-1``'s (``batch_isend_irecv`` on the default group), waited
   for at once: on the step's path, between two steps (an exchange left in
   flight into the next step aborted a survivor when its peers died);
3. one one-element ``all_reduce(MIN)`` agrees every rank has both halves
   before any commits the pair (own snapshot, copy of ``r-1``): a death
   during the copy leaves every rank on the previous pair.

On a death (:func:`dpnb.engine.rebuild.from_peers`) every rank rolls back to
its own snapshot and the replaced rank takes its buffer from ``r+1``'s copy;
two neighbours lost together take a shard and its only copy: the session
falls back to a disk checkpoint.  On a GPU the pack is a device-to-host copy
on the compute stream and the ring stages through the device (not measured here).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import compat
from ..core.strategies import is_fsdp
from .state import get_state
from .train_state import TrainError

log = logging.getLogger(__name__)

DEFAULT_EVERY = 10
SHARDED = ("zero1", "zero2", "zero3")


@dataclass
class PeerState:
    """One rank's committed pair and the exchange in flight (``EngineState.peer``)."""

    every: int | None = None  # None: DEFAULT_EVERY under the sharded strategies, else off
    own: torch.Tensor | None = None  # this rank's snapshot (uint8, CPU)
    own_step: int | None = None
    copy: torch.Tensor | None = None  # the left neighbour's snapshot
    copy_of: int | None = None
    pending: tuple | None = None  # (own buffer, receive buffer, step, left) until agreed
    owner: int | None = None  # id() of the TrainState the pair was taken from
    sizes: tuple | None = None  # ((generation, owner), meta room, left's bytes): fixed per wrap

    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.own, self.copy) if t is not None)

    def drop(self) -> None:
        """Forget the pair: copies off, or taken from another wrap (a rollback to
        them would go back to another model, or behind a fresher checkpoint)."""
        self.own = self.own_step = self.copy = self.copy_of = self.owner = None


def peer_state(es) -> PeerState:
    if es.peer is None:
        es.peer = PeerState()
    return es.peer


def every_for(es, st) -> int:
    """The copy interval in force for this wrap (0: off)."""
    ps = peer_state(es)
    if ps.every is not None:
        return ps.every
    return DEFAULT_EVERY if st.strategy in SHARDED else 0


def set_every(ns: dict, every: int) -> dict:
    """Copy every ``every`` steps (0: never).  Local; call it on every rank alike."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise TrainError(f"the peer-copy interval must be a whole number of steps >= 0 (got {every!r})")
    ps = peer_state(get_state(ns))
    ps.every = every
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


def _plain(v):
    if isinstance(v, torch.Tensor):
        return float(v)
    return list(v) if isinstance(v, tuple) else v


def pack(st, cap: int | None = None) -> torch.Tensor:
    """``[meta length][meta JSON][every local tensor's bytes]`` in one CPU uint8 buffer;
    with ``cap`` the JSON is padded to ``cap`` bytes, so the buffer's size stays
    fixed from copy to copy (the step and the data position grow digits)."""
    ts = local_tensors(st)
    d = st.data
    meta = json.dumps({
        "step": st.step, "strategy": st.strategy, "lr_scale_applied": st.lr_scale_applied,
        "groups": [{k: _plain(v) for k, v in g.items() if k != "params"}
                   for g in st.optimizer.param_groups],
        "scaler": ({k: _plain(v) for k, v in st.scaler.state_dict().items()}
                   if st.scaler is not None else None),
        "data": None if d is None else [d.seed, d.shuffle, d.epoch, d.offset, len(d.dataset)],
        "layout": [[list(t.shape), str(t.dtype).split(".")[-1]] for t in ts],
    }).encode()
    if cap is not None:
        if len(meta) > cap:
            raise TrainError(f"the peer copy's description grew past {cap} bytes: re-wrap")
        meta += b" " * (cap - len(meta))  # JSON ignores trailing blanks
    parts = [torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8),
             torch.tensor(list(meta), dtype=torch.uint8)]
    parts += [t.detach().reshape(-1).view(torch.uint8).cpu() for t in ts]
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
    for g, h in zip(st.optimizer.param_groups, meta["groups"]):
        for k, v in h.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    st.step = int(meta["step"])
    st.lr_scale_applied = float(meta["lr_scale_applied"])
    if st.scaler is not None and meta["scaler"]:
        st.scaler.load_state_dict(meta["scaler"])
    if st.data is not None and meta["data"] is not None:
        seed, shuffle, epoch, offset, n = meta["data"]
        if len(st.data.dataset) == n:
            st.data.seed, st.data.shuffle, st.data.epoch, st.data.offset = seed, shuffle, epoch, offset
            st.data._key = None
    return meta


def ring(es, send: torch.Tensor, recv: torch.Tensor, to: int, frm: int) -> None:
    """``send`` to rank ``to``, ``recv`` filled from rank ``frm``, as one
    ``all_to_all_single`` whose other splits are empty.  A collective, not
    gloo's send/recv: point-to-point receives left posted when a peer died
    aborted the survivor (SIGABRT), where a collective fails with an error."""
    ins, outs = [0] * es.world_size, [0] * es.world_size
    ins[to], outs[frm] = send.numel(), recv.numel()
    dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins)


class Copier:
    """The train loop's peer copies: ``after(issued)`` once per step (it hands
    ``issued`` back, so the loop calls it in the same line); a copy a failed
    step left unfinished is dropped when the call ends."""

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
        if self.ps.pending is None:
            return
        if kind is None:
            self._complete()
        else:  # the step failed: this copy never completes; the last committed pair stays
            self.ps.pending = None

    def after(self, issued):
        if self.every and self.st.step % self.every == 0:
            # Issued and completed here, not at the next step: an exchange left
            # in flight when a peer died aborted the survivor's process (gloo,
            # SIGABRT, seen in tests/cluster/test_resume_memory.py's two-death case)
            self._issue()
            self._complete()
        return issued

    def _issue(self) -> None:
        ps = self.ps
        key = (self.es.generation, id(self.st))
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
            ps.sizes = (key, cap, int(m[(self.es.rank - 1) % self.es.world_size]))
        else:
            own = pack(self.st, ps.sizes[1])
        send = own.to(self.cdev)  # a copy only where the group sends device memory (NCCL)
        recv = torch.empty(ps.sizes[2], dtype=torch.uint8, device=self.cdev)
        left = (self.es.rank - 1) % self.es.world_size
        ring(self.es, send, recv, (self.es.rank + 1) % self.es.world_size, left)
        self.ps.pending = (own, recv, self.st.step, left)

    def _complete(self) -> None:
        own, recv, step, left = self.ps.pending
        self.ps.pending = None
        ok = torch.ones(1, device=self.cdev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank has both halves: commit
        self.ps.own, self.ps.own_step, self.ps.owner = own, step, id(self.st)
        self.ps.copy, self.ps.copy_of = recv.cpu(), left


def info(ns: dict) -> dict:
    """This rank's committed pair, for the session's choice.  Local."""
    es = get_state(ns)
    ps = peer_state(es)
    copy_step = meta_of(ps.copy)[0]["step"] if ps.copy is not None else None
    return {"own_step": ps.own_step, "copy_of": ps.copy_of, "copy_step": copy_step,
            "bytes": ps.nbytes(), "every": every_for(es, es.train) if es.train else None,
            "fsdp": bool(es.train and is_fsdp(es.train.strategy))}
