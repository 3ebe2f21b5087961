"""Choosing the dataset ``train`` reads on every rank, sharded with ``DistributedSampler``.

No communication: the dataset must be built identically on every rank; each
rank then reads only its share.
"""

from __future__ import annotations

import torch

from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import DataState, TrainError, TrainState


def set_data(ns: dict, dataset, *, seed: int = 0, shuffle: bool = True) -> dict:
    """Choose the map-style dataset ``train`` reads, sharded over the ranks.

    ``dataset`` is a Dataset object or the name of one in ``ns``.  Each rank
    reads only its ``DistributedSampler`` share (seeded with ``seed``; the
    epoch is set with ``set_epoch`` at each epoch start, so shuffles differ per
    epoch yet agree across ranks).  No communication: the dataset must be
    built identically on every rank.  Resets the position to epoch 0.
    """
    es = get_state(ns)
    name = dataset if isinstance(dataset, str) else type(dataset).__name__
    if isinstance(dataset, str):
        if dataset not in ns:
            cands = sorted(
                k for k, v in ns.items()
                if not k.startswith("_") and hasattr(v, "__len__") and hasattr(v, "__getitem__")
                and not isinstance(v, (str, bytes, dict, list, tuple, torch.Tensor))
            )
            raise TrainError(
                f"there is no dataset {dataset!r} on rank {es.rank}: define it in a "
                f"%%dp cell first (e.g. `{dataset} = dpnb.data.SyntheticRegression()`). "
                f"Dataset-like objects here: {cands or 'none'}"
            )
        dataset = ns[dataset]
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TrainError(
            f"{name} is not a map-style dataset (needs __len__ and __getitem__); "
            "wrap an iterable in a list or implement torch.utils.data.Dataset"
        )
    if len(dataset) < es.world_size:
        raise TrainError(
            f"dataset {name} has {len(dataset)} samples, fewer than the "
            f"{es.world_size} ranks; use a larger dataset"
        )
    ds = DataState(dataset=dataset, name=name, seed=int(seed), shuffle=bool(shuffle))
    if es.train is not None:
        es.train.data = ds
    else:
        es.pending_data = ds
    return ds.summary(es.world_size)


def current_data(es, st: TrainState) -> DataState:
    """The dataset ``train`` reads: the one chosen for this wrap, or before it."""
    if st.data is None and es.pending_data is not None:
        st.data, es.pending_data = es.pending_data, None
    if st.data is None:
        raise TrainError(
            "no dataset chosen: run `%dp data DATASET` "
            "(dpnb.engine.train.training.set_data(ns, 'DATASET')) first"
        )
    return st.data

