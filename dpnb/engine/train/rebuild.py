"""Rebuilding a replaced rank from a survivor's replica (``%dp restart --resume``, no DIR).

Under DDP every rank holds the whole training state: the same parameters, the
same optimizer state, the same step counter and data position.  When one
engine dies, the survivors keep theirs; this module copies one survivor's
(``src``) onto every other rank over the re-formed process group, the way
torchft heals a replaced replica group from a live peer -- no disk involved.

Who communicates what, in order (every rank calls :func:`from_replica` at once):

1. ``src`` broadcasts the module's parameters and buffers into the module each
   rank holds -- the survivors' own, the replaced rank's one just rebuilt by
   the replayed setup cells (not wrapped yet: a fresh DDP would broadcast
   *rank 0's* weights, and rank 0 may be the replaced one).
2. DDP is built again on every rank: survivors re-bind their wrapper
   (:func:`dpnb.engine.train.wrap.rebind`), the replaced rank wraps (:func:`dpnb.
   engine.wrap.wrap`, with the arguments of the session's last wrap); both are
   the same DDP construction, the same collectives.
3. ``src`` broadcasts a small JSON description (step, data epoch/offset/seed,
   learning-rate scale, the optimizer's hyper-parameters, the gradient
   scaler, each parameter's optimizer-state keys/shapes/dtypes), then every
   optimizer-state tensor in parameter order.  The other ranks allocate the
   state from the description and receive into it.

Survivors receive too, not only the replaced rank: a rank killed inside a
ring all-reduce can leave one survivor a step further than another; the
session picks the furthest as ``src`` and every rank ends with its state.
Sharded state (ZeRO-1's optimizer partitions, FSDP shards) has no replica;
:func:`from_peers` rolls every rank back to the last copy in peer memory
(:mod:`.peercopy`) instead, the replaced rank taking its buffer from its right
neighbour's copy.  Where neither serves, the session falls back to a disk
checkpoint.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from dpnb.core.strategies import is_fsdp
from dpnb.engine.train import peercopy
from dpnb.engine.train.checkpoint import _materialize_state
from dpnb.engine.state import get_state
from dpnb.engine.train.snapshot import plain, restore_scalars, scalars_of
from dpnb.engine.train.train_state import TrainError
from dpnb.engine.train.wrap import _resolve_model, rebind, wrap

__all__ = ["replica_info", "from_replica", "from_peers"]

#: strategies whose whole training state is replicated on every rank
REPLICATED = ("ddp",)


def replica_info(ns: dict) -> dict:
    """What this (surviving) rank holds, for the session to choose a source.
    Local, no communication."""
    es = get_state(ns)
    st = es.train
    if st is None:
        return {"rank": es.rank, "wrapped": False}
    return {"rank": es.rank, "wrapped": True, "strategy": st.strategy, "step": st.step,
            "model": st.model_name, "replicated": st.strategy in REPLICATED,
            "peer": peercopy.info(ns)}


def _bcast(t: torch.Tensor, src: int, cdev) -> None:
    """Broadcast ``t`` in place; through the communication device when ``t``
    lives elsewhere (an NCCL group sends GPU tensors only; Adam's ``step`` is
    a CPU tensor)."""
    if t.device == torch.device(cdev) and t.is_contiguous():
        dist.broadcast(t, src=src)
        return
    tmp = t.detach().to(cdev).contiguous()
    dist.broadcast(tmp, src=src)
    with torch.no_grad():
        t.copy_(tmp)


def _bcast_json(obj, src: int, rank: int, cdev):
    """``obj`` (builtins) from ``src`` to every rank, as UTF-8 JSON bytes in a
    uint8 tensor: a length, then the bytes -- no pickle crosses the group."""
    data = json.dumps(obj).encode() if rank == src else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=cdev)
    dist.broadcast(n, src=src)
    if rank == src:
        buf = torch.tensor(list(data), dtype=torch.uint8, device=cdev)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=cdev)
    dist.broadcast(buf, src=src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def _describe(st) -> dict:
    """The source's non-tensor state and the layout of its optimizer state."""
    opt = st.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    layout = []
    for p in params:
        entry = {}
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                entry[k] = ["t", list(v.shape), str(v.dtype).split(".")[-1], v.device == p.device]
            else:
                entry[k] = ["v", plain(v)]
        layout.append(entry)
    return {**scalars_of(st), "layout": layout}


def _apply(st, desc: dict, src: int, rank: int, cdev) -> None:
    """Take the source's description; allocate the optimizer state it lists
    (on ranks other than ``src``); receive every state tensor in order."""
    opt = st.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    if len(params) != len(desc["layout"]):
        raise TrainError(f"rank {rank}'s optimizer has {len(params)} parameters, rank {src}'s "
                         f"{len(desc['layout'])}: the replayed cells built another model")
    for p, entry in zip(params, desc["layout"]):
        if rank != src:
            s = {}
            for k, spec in entry.items():
                if spec[0] == "t":
                    dev = p.device if spec[3] else torch.device("cpu")
                    s[k] = torch.empty(spec[1], dtype=getattr(torch, spec[2]), device=dev)
                else:
                    s[k] = spec[1]
            opt.state[p] = s
        for k in sorted(entry):
            if entry[k][0] == "t":
                _bcast(opt.state[p][k], src, cdev)
    restore_scalars(st, desc, other_data=lambda ours, theirs: TrainError(
        f"rank {rank}'s dataset has {ours} samples, rank {src}'s {theirs}: the replayed "
        f"cells built another dataset"))
    opt.zero_grad(set_to_none=True)


def from_replica(ns: dict, src: int, wrap_args: tuple, wrap_kwargs: dict) -> dict:
    """Give every rank ``src``'s training state (collective; see the module doc).

    A rank that holds a wrapped model is a survivor and keeps its objects; a
    rank without one was replaced: its setup cells rebuilt the model (and the
    dataset, chosen before this call), and it wraps here with ``wrap_args`` /
    ``wrap_kwargs`` -- the session's last wrap."""
    es = get_state(ns)
    survivor = es.train is not None
    if survivor and es.train.strategy not in REPLICATED:
        raise TrainError(f"{es.train.strategy}'s optimizer state is sharded: no rank holds "
                         "the replaced rank's part; resume from a checkpoint")
    module = es.train.module if survivor else _resolve_model(ns, wrap_args[0], es.rank)
    module.to(torch.device(es.device))
    cdev = es.comm_device
    with torch.no_grad():  # 1. the survivor's weights, before any DDP broadcasts rank 0's
        for t in list(module.parameters()) + list(module.buffers()):
            _bcast(t.data, src, cdev)
    if survivor:  # 2. the same DDP construction on every rank
        rebind(ns)
    else:
        wrap(ns, *wrap_args, **wrap_kwargs)
        if es.train.data is None and es.pending_data is not None:
            es.train.data, es.pending_data = es.pending_data, None
    st = es.train
    desc = _bcast_json(_describe(st) if es.rank == src else None, src, es.rank, cdev)
    _apply(st, desc, src, es.rank, cdev)  # 3.
    return {"rank": es.rank, "fresh": not survivor, "step": st.step, "src": src,
            "data": None if st.data is None else [st.data.epoch, st.data.offset]}


def _rewrap(ns: dict, es, wrap_args: tuple, wrap_kwargs: dict) -> bool:
    """ZeRO-1 survivors re-bind (their DDP and partitions live on); a replaced
    rank, and under FSDP every rank (its cells rebuilt the module), wraps.
    The same collectives everywhere: DDP's construction, or FSDP's broadcast,
    mesh and sharding.  True where the optimizer is new (its state empty)."""
    st = es.train
    if st is not None and not is_fsdp(st.strategy):
        rebind(ns)
        return False
    wrap(ns, *wrap_args, **wrap_kwargs)
    if es.train.data is None and es.pending_data is not None:
        es.train.data, es.pending_data = es.pending_data, None
    return True


def from_peers(ns: dict, holders: dict, wrap_args: tuple, wrap_kwargs: dict) -> dict:
    """Roll every rank back to the last committed peer copy (collective).

    ``holders``: replaced rank (as a str: JSON keys) -> the survivor holding
    its copy (the next rank, or one on another host).  Every rank wraps or re-binds
    (:func:`_rewrap`); each holder sends its copy to the rank it covers
    (size, then bytes: point-to-point); survivors take their own snapshot.
    Then each rank copies the buffer into its tensors -- parameter shards,
    buffers, optimizer state -- and takes its step, data position, learning
    rates and loss scaler: every rank is at the snapshot's step."""
    es = get_state(ns)
    holders = {int(d): int(h) for d, h in holders.items()}
    ps = peercopy.peer_state(es)
    ps.settle(es.timeout_s)
    own, own_step = ps.own, ps.own_step
    # a survivor's loss records, kept across its re-wrap (FSDP makes a new TrainState)
    before = list(es.train.records) if es.train is not None else []
    fresh = _rewrap(ns, es, wrap_args, wrap_kwargs)
    st = es.train
    if fresh:
        _materialize_state(peercopy._inner(st))  # the state the snapshot's tensors go into
    cdev = es.comm_device
    for d, h in sorted(holders.items()):  # one pair at a time: every rank walks the same list
        n = torch.tensor([ps.copy.numel() if es.rank == h else 0], dtype=torch.int64,
                         device=cdev)
        dist.broadcast(n, src=h)  # the size, then the bytes, holder to replaced rank only
        send = ps.copy.to(cdev) if es.rank == h else torch.empty(0, dtype=torch.uint8, device=cdev)
        buf = torch.empty(int(n.item()) if es.rank == d else 0, dtype=torch.uint8, device=cdev)
        peercopy.ring(es, send, buf, d, h)
        if es.rank == d:
            own = buf.cpu()
            own_step = peercopy.meta_of(own)[0]["step"]
    if own is None:
        raise TrainError(f"rank {es.rank} holds no snapshot to roll back to")
    peercopy.unpack_into(st, own)
    # the records go on from the snapshot's step: those before it carried
    # over, the undone steps past it dropped (not shown beside their redone ones)
    kept = [r for r in before if r.step < st.step]
    st.records.clear()
    st.records.extend(kept)
    if es.rank in holders:  # a replaced rank: the copy it held was lost with it
        ps.own, ps.own_step, ps.copy, ps.copy_of, ps.owner = own, own_step, None, None, id(st)
    ps.owner = id(st)  # the pair is this state's now, a re-wrap's too: a second death can use it
    st.optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return {"rank": es.rank, "step": st.step, "fresh": fresh}
