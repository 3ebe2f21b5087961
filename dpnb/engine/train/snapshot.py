"""A rank's training scalars -- step, learning rates, loss scaler, data position --
as JSON, and back.

What a replaced rank needs besides its tensors, in one shape for both ways of
recovering from memory: the peer copies (:mod:`dpnb.engine.train.peercopy`,
packed beside the shard in a neighbour's CPU memory) and the rebuild from a
survivor's replica (:mod:`dpnb.engine.train.rebuild`, broadcast over the
re-formed group).  No communication here.
"""

from __future__ import annotations

import torch


def plain(v):
    """An optimizer hyper-parameter as JSON (tensors as floats, tuples as lists)."""
    if isinstance(v, torch.Tensor):
        return float(v)
    return list(v) if isinstance(v, tuple) else v


def scalars_of(st) -> dict:
    """``st``'s step, lr scale, optimizer groups (no params), scaler and data position."""
    d = st.data
    return {
        "step": st.step,
        "lr_scale_applied": st.lr_scale_applied,
        "groups": [{k: plain(v) for k, v in g.items() if k != "params"}
                   for g in st.optimizer.param_groups],
        "scaler": ({k: plain(v) for k, v in st.scaler.state_dict().items()}
                   if st.scaler is not None else None),
        "data": None if d is None else {"seed": d.seed, "shuffle": d.shuffle, "epoch": d.epoch,
                                         "offset": d.offset, "len": len(d.dataset)},
    }


def restore_scalars(st, s: dict, *, other_data=None) -> None:
    """Put :func:`scalars_of`'s ``s`` back into ``st``.  A dataset of another length
    keeps its own position, or raises ``other_data(ours, theirs)`` when given."""
    for g, h in zip(st.optimizer.param_groups, s["groups"]):
        for k, v in h.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    st.step = int(s["step"])
    st.lr_scale_applied = float(s["lr_scale_applied"])
    if st.scaler is not None and s["scaler"]:
        st.scaler.load_state_dict(s["scaler"])
    dd = s["data"]
    if st.data is None or dd is None:
        return
    if len(st.data.dataset) != dd["len"]:
        if other_data is not None:
            raise other_data(len(st.data.dataset), dd["len"])
        return
    st.data.seed, st.data.shuffle = dd["seed"], dd["shuffle"]
    st.data.epoch, st.data.offset = dd["epoch"], dd["offset"]
    st.data._key = None  # the sampler's order is rebuilt for this epoch
