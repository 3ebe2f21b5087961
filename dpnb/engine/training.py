"""Data-parallel training inside each engine: wrap, data, train.

Every function here runs on *every* rank at the same time (the notebook calls
it by name on all engines), takes the engine's user namespace ``ns`` first,
and keeps what it builds in ``ns`` under names the user can reach from
``%%dp`` cells (``model``, ``optimizer`` by default) plus a private
:class:`TrainState` in ``ns["_dpnb"].extras["train"]``.  Return values are
small dicts of builtins: they travel back to the notebook over ipyparallel.

The distributed story, strategy by strategy
-------------------------------------------
``ddp``
    Every rank holds the whole model, gradients and optimizer state.
    ``DistributedDataParallel`` broadcasts rank 0's parameters once at wrap
    time, then during the backward of the *last* micro-batch of a step
    all-reduces (averages) gradients bucket by bucket, launching each bucket's
    all-reduce as soon as its gradients are ready so communication overlaps
    the rest of backward.  Every rank then takes the same optimizer step.
``zero1``
    DDP for gradients, plus ``ZeroRedundancyOptimizer``: each rank keeps
    optimizer state only for the *whole* parameters assigned to it (greedy by
    size), steps only those, and broadcasts the updated parameters to the
    other ranks after the step.
``zero2``
    FSDP2 ``fully_shard(reshard_after_forward=False)``: parameters, gradients
    and optimizer state are sharded on dim 0 across ranks.  Forward
    all-gathers each unit's parameters and keeps them until backward; backward
    reduce-scatters gradients so each rank receives only its shard's average.
``zero3``
    Like zero2 but ``reshard_after_forward=True``: each unit (a block, or a
    class you name with ``wrap_classes``) frees its gathered parameters after
    forward and all-gathers them again in backward -- least memory, most
    communication.  Units are sharded first, then the root.

Gradient accumulation: with ``grad_accum=K`` a step runs ``K`` micro-batches;
gradient synchronization happens only in the backward of the last one
(``no_sync()`` for DDP, ``set_requires_gradient_sync(False)`` for FSDP2), each
micro-batch loss is divided by ``K``, and since DDP/FSDP average over the
``N`` ranks the resulting gradient is that of the mean loss over the global
batch of ``micro_batch * N * K`` samples -- the same gradient one process
would get from that whole batch.  The identity is checked on every step: the
per-rank sample counts are gathered and must add up to the global batch.

Per step, besides the gradient collectives, the loop issues exactly one small
extra collective: an ``all_gather`` of ``[loss, stop flag, compute seconds,
samples]`` from every rank.  It gives the global mean loss, makes all ranks
stop at the same step boundary after Ctrl-C / Stop, feeds the straggler view
and checks the global batch size.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, default_collate

from .measure import BucketRecorder, local_tensor, state_bytes
from .state import get_state

__all__ = [
    "TrainError",
    "TrainState",
    "STRATEGIES",
    "wrap",
    "set_data",
    "train",
    "records",
    "clear_records",
    "set_recording",
    "rebind",
    "train_state",
    "require_bound",
    "fsdp_units",
    "default_loss",
]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MIXED_PRECISION = ("none", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCALES = ("none", "linear", "sqrt")
TRAIN_KEY = "train"
MAX_RECORDS = 100_000
# Counting the bytes every step costs ~1 ms of Python on a small model
# (about 1 % of a step); they change only when tensors are (re)allocated.
BYTES_EVERY = 25


class TrainError(RuntimeError):
    """A mistake the user can fix; the message says what to do."""


# --------------------------------------------------------------------------
# state kept on the engine


@dataclass
class DataState:
    """Where this rank is in the (sharded) dataset.

    Position is kept as the number of *global* samples consumed in the current
    epoch.  Because ``DistributedSampler`` deals the epoch's permutation
    round-robin (rank ``r`` gets ``perm[r::N]``), the first ``n`` global
    samples are always ``perm[:n]`` whatever ``N`` is -- so a run can resume
    at the same place under another world size."""

    dataset: Any
    name: str
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0  # global samples consumed in this epoch
    _indices: list | None = None
    _key: tuple | None = None

    def per_rank_len(self, world_size: int) -> int:
        return len(self.dataset) // world_size

    def _rank_indices(self, rank: int, world_size: int) -> list:
        key = (self.epoch, rank, world_size)
        if self._key != key:
            sampler = DistributedSampler(
                self.dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=self.shuffle,
                seed=self.seed,
                drop_last=True,
            )
            sampler.set_epoch(self.epoch)
            self._indices = list(iter(sampler))
            self._key = key
        return self._indices

    def ensure_room(self, per_rank_need: int, rank: int, world_size: int) -> None:
        """Start the next epoch if this one has fewer than ``per_rank_need``
        samples left per rank (the tail of an epoch is dropped)."""
        if self.offset % world_size:
            # Resumed under a world size that does not divide the position.
            self.offset -= self.offset % world_size
        pos = self.offset // world_size
        if pos + per_rank_need > len(self._rank_indices(rank, world_size)):
            self.epoch += 1
            self.offset = 0

    def micro_batch(self, k: int, batch: int, rank: int, world_size: int):
        idx = self._rank_indices(rank, world_size)
        start = self.offset // world_size + k * batch
        items = [self.dataset[i] for i in idx[start : start + batch]]
        return default_collate(items), len(items)

    def summary(self, world_size: int) -> dict:
        return {
            "dataset": self.name,
            "len": len(self.dataset),
            "per_rank": self.per_rank_len(world_size),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "offset": self.offset,
        }


@dataclass
class TrainState:
    """Everything the training layer keeps on one engine."""

    strategy: str
    config: dict  # the wrap() arguments, for checkpoints and re-binding
    model_name: str
    model_out: str
    optimizer_out: str
    module: nn.Module  # the original module (FSDP2 shards it in place)
    wrapped: nn.Module  # DDP(module) or the FSDP-sharded module
    optimizer: Any
    world_size: int
    generation: int
    device: Any
    mesh: Any = None
    recorder: BucketRecorder | None = None
    scaler: Any = None
    ddp_kwargs: dict = field(default_factory=dict)
    step: int = 0  # optimizer steps taken so far (global step index)
    lr_scale_applied: float = 1.0
    data: DataState | None = None
    record_default: bool = True
    records: deque = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))


def train_state(ns: dict) -> TrainState:
    """This engine's :class:`TrainState`, with a clear error if none exists."""
    st = get_state(ns).extras.get(TRAIN_KEY)
    if st is None:
        raise TrainError(
            "no model is wrapped on this engine yet: run `%dp wrap MODEL "
            "--strategy ddp` (dpnb.engine.training.wrap(ns, 'MODEL', 'ddp')) first"
        )
    return st


def require_bound(ns: dict) -> TrainState:
    """The TrainState, provided its wrappers use the current process group.

    After the group is re-formed, the ``on_reform`` callback re-binds them.
    If it did not run (e.g. some engines were replaced by fresh ones), going
    on would run collectives over a dead group or hang, so say what to do."""
    es = get_state(ns)
    st = train_state(ns)
    if st.generation != es.generation:
        raise TrainError(
            "the process group was re-formed after this model was wrapped and the "
            "wrapper was not re-bound to the new group: run `%dp wrap` again on every "
            "rank (or dpnb.engine.training.rebind(ns) on every rank if all of them "
            "still hold their model)"
        )
    return st


def _choice(value: str, allowed: tuple, what: str) -> str:
    v = str(value).lower().replace("-", "")
    for a in allowed:
        if v == a.replace("-", ""):
            return a
    raise TrainError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")


# --------------------------------------------------------------------------
# wrap


def _module_names(ns: dict) -> list:
    return sorted(k for k, v in ns.items() if isinstance(v, nn.Module) and not k.startswith("_"))


def _resolve_model(ns: dict, model_name: str, rank: int) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model_name, str):
        raise TrainError(
            f"wrap() takes the model's *name* in the engine namespace (a str), "
            f"got {type(model_name).__name__}"
        )
    if model_name not in ns:
        names = _module_names(ns)
        raise TrainError(
            f"there is no {model_name!r} on rank {rank}: define the model in a %%dp "
            f"cell first (e.g. `{model_name} = MyNet()`). nn.Modules on this rank: "
            f"{names or 'none'}"
        )
    obj = ns[model_name]
    if isinstance(obj, DDP):
        obj = obj.module
    if isinstance(obj, FSDPModule):
        raise TrainError(
            f"{model_name!r} is already sharded with FSDP (zero2/zero3); fully_shard "
            "changes a module in place and cannot be undone. Build a fresh model "
            "and wrap that (use `%dp save`/`%dp load` to carry the weights over)"
        )
    if not isinstance(obj, nn.Module):
        raise TrainError(
            f"{model_name!r} is a {type(obj).__name__}, not a torch.nn.Module"
        )
    if not any(p.requires_grad for p in obj.parameters()):
        raise TrainError(f"{model_name!r} has no trainable parameters")
    return obj


def _build_optimizer(strategy, params, name, lr, weight_decay, momentum, betas):
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        kw = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas or (0.9, 0.999))}
    else:
        cls = torch.optim.SGD
        kw = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kw)
    return cls(params, **kw)


def fsdp_units(module: nn.Module, wrap_classes=None) -> list:
    """Names of the submodules that become their own FSDP unit, innermost first.

    ``wrap_classes`` (class objects or class names) selects every submodule of
    those classes.  Without it: every child of every ``nn.ModuleList`` (the
    usual stack of transformer blocks), or if there is none, every direct child
    that has parameters.  The root is always sharded last, on top.
    """
    named = list(module.named_modules())
    if wrap_classes:
        wanted = [wrap_classes] if isinstance(wrap_classes, (str, type)) else list(wrap_classes)
        names_ = {w for w in wanted if isinstance(w, str)}
        classes = tuple(w for w in wanted if isinstance(w, type))
        picked = [
            n for n, m in named
            if n and (type(m).__name__ in names_ or (classes and isinstance(m, classes)))
        ]
        if not picked:
            raise TrainError(
                f"no submodule matches --wrap {sorted(map(str, wanted))}; classes in "
                f"this model: {sorted({type(m).__name__ for _, m in named})}"
            )
    else:
        picked = []
        for n, m in named:
            if isinstance(m, nn.ModuleList):
                picked += [f"{n}.{c}" if n else c for c, _ in m.named_children()]
        if not picked:
            picked = [n for n, m in module.named_children() if any(True for _ in m.parameters())]
    mods = dict(named)
    picked = [n for n in picked if any(True for _ in mods[n].parameters())]
    # fully_shard must go bottom-up: descendants before their ancestors.
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(set(picked), key=lambda n: -order[n])


def _broadcast_from_rank0(module: nn.Module) -> None:
    # FSDP shards whatever each rank holds, unlike DDP it does not broadcast
    # first; do it so ranks that built their model without a common seed
    # still start from one model.
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)


def _release(st: TrainState) -> None:
    """Drop the hooks an earlier wrap left on parameters."""
    if st.recorder is not None:
        st.recorder.detach()
    remove = getattr(st.wrapped, "_remove_autograd_hooks", None)
    if remove is not None:
        with contextlib.suppress(Exception):
            remove()


def wrap(
    ns: dict,
    model_name: str,
    strategy: str = "ddp",
    *,
    bucket_cap_mb: float | None = None,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
    wrap_classes=None,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    betas=None,
    model_out: str = "model",
    optimizer_out: str = "optimizer",
    record_buckets: bool = True,
) -> dict:
    """Wrap ``ns[model_name]`` for data-parallel training with ``strategy``.

    Collective: every rank must call it.  DDP broadcasts rank 0's parameters
    and buffers; for zero2/zero3 this function does the same broadcast before
    sharding, then FSDP2 keeps only each rank's dim-0 shard.

    The wrapped model is put in ``ns[model_out]`` and its optimizer in
    ``ns[optimizer_out]``; the original module stays reachable as
    ``ns[model_name]`` (and as ``.module`` of the DDP wrapper; FSDP2 shards
    the original object in place).

    ``bucket_cap_mb`` (DDP/zero1): gradient bucket size; ``None`` keeps
    DDP's default (25 MiB, with a 1 MiB first bucket); a value sets every
    bucket, the first included.  ``gradient_as_bucket_view`` is on, so
    gradients live inside the buckets instead of in separate copies.

    ``mixed_precision``: ``bf16``/``fp16`` run forward/backward in half
    precision -- ``torch.autocast`` for ddp/zero1, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`` for
    zero2/zero3 (gradients are reduced in fp32).  fp16 needs CUDA and uses a
    ``GradScaler``.  ``cpu_offload`` (zero2/zero3 on CUDA) keeps sharded
    parameters, gradients and optimizer state in host memory.

    ``record_buckets`` registers the DDP comm hook that records bucket
    timings (cheap, switched on per ``train(record=...)``).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    es = get_state(ns)
    strategy = _choice(strategy, STRATEGIES, "strategy")
    mp = _choice(mixed_precision, MIXED_PRECISION, "mixed precision")
    opt_name = _choice(optimizer, OPTIMIZERS, "optimizer")
    dev = torch.device(es.device)
    if mp == "fp16" and dev.type != "cuda":
        raise TrainError(
            f"--mixed-precision fp16 needs CUDA (loss scaling, fp16 kernels); rank "
            f"{es.rank} runs on {dev.type}. Use --mixed-precision bf16 or none"
        )
    if cpu_offload and strategy not in ("zero2", "zero3"):
        raise TrainError(
            f"--cpu-offload applies to the FSDP strategies zero2/zero3, not {strategy}"
        )
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise TrainError(f"--bucket-cap-mb must be > 0, got {bucket_cap_mb}")
    module = _resolve_model(ns, model_name, es.rank)
    if not dist.is_initialized():
        raise TrainError(
            "torch.distributed is not initialized on this engine: start the "
            "cluster with dpnb.start() before wrapping"
        )

    old = es.extras.get(TRAIN_KEY)
    if old is not None:
        _release(old)
        es.extras.pop(TRAIN_KEY, None)

    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    module.to(dev)
    notes: list[str] = []
    mesh = None
    recorder = None
    ddp_kwargs: dict = {}
    units: list[str] = []

    if strategy in ("ddp", "zero1"):
        ddp_kwargs = {
            "device_ids": [dev.index if dev.index is not None else torch.cuda.current_device()]
            if dev.type == "cuda" else None,
            "gradient_as_bucket_view": True,
        }
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        wrapped = DDP(module, **ddp_kwargs)
        if record_buckets:
            recorder = BucketRecorder(module, dev)
            recorder.attach(wrapped)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _broadcast_from_rank0(module)
        mesh = init_device_mesh(dev.type, (es.world_size,))
        kw: dict = {"mesh": mesh, "reshard_after_forward": strategy == "zero3"}
        if mp != "none":
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if mp == "bf16" else torch.float16,
                reduce_dtype=torch.float32,
            )
        if cpu_offload:
            if dev.type == "cuda":
                kw["offload_policy"] = CPUOffloadPolicy()
            else:
                notes.append("cpu_offload ignored: the ranks already run on CPU")
        units = fsdp_units(module, wrap_classes)
        mods = dict(module.named_modules())
        for name in units:
            fully_shard(mods[name], **kw)
        fully_shard(module, **kw)
        wrapped = module
        if bucket_cap_mb is not None:
            notes.append("bucket_cap_mb applies to DDP buckets; FSDP communicates per unit")

    opt = _build_optimizer(strategy, list(module.parameters()), opt_name, lr, weight_decay, momentum, betas)
    scaler = torch.amp.GradScaler("cuda") if mp == "fp16" else None

    config = {
        "strategy": strategy,
        "bucket_cap_mb": bucket_cap_mb,
        "mixed_precision": mp,
        "cpu_offload": bool(cpu_offload),
        "wrap_classes": [w if isinstance(w, str) else w.__name__ for w in (
            [wrap_classes] if isinstance(wrap_classes, (str, type)) else (wrap_classes or []))],
        "optimizer": opt_name,
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "betas": list(betas) if betas else None,
    }
    st = TrainState(
        strategy=strategy,
        config=config,
        model_name=model_name,
        model_out=model_out,
        optimizer_out=optimizer_out,
        module=module,
        wrapped=wrapped,
        optimizer=opt,
        world_size=es.world_size,
        generation=es.generation,
        device=dev,
        mesh=mesh,
        recorder=recorder,
        scaler=scaler,
        ddp_kwargs=ddp_kwargs,
    )
    # A dataset chosen before this wrap keeps its position.
    if old is not None and old.data is not None:
        st.data = old.data
    es.extras[TRAIN_KEY] = st
    # once per engine, even if this module was reloaded since
    if not any(getattr(cb, "__qualname__", None) == "_on_reform"
               and getattr(cb, "__module__", None) == __name__ for cb in es.on_reform):
        es.on_reform.append(_on_reform)
    ns[model_out] = wrapped
    ns[optimizer_out] = opt

    n_global = sum(p.numel() for p in module.parameters())
    return {
        "rank": es.rank,
        "world_size": es.world_size,
        "strategy": strategy,
        "model": model_name,
        "model_out": model_out,
        "optimizer_out": optimizer_out,
        "optimizer": opt_name,
        "lr": lr,
        "device": str(dev),
        "n_params": int(n_global),
        "n_tensors": len(list(module.parameters())),
        "local_param_numel": int(sum(local_tensor(p).numel() for p in module.parameters())),
        "mixed_precision": mp,
        "bucket_cap_mb": bucket_cap_mb,
        "fsdp_units": units,
        "notes": notes,
    }


# --------------------------------------------------------------------------
# data


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
    st = es.extras.get(TRAIN_KEY)
    if st is not None:
        st.data = ds
    else:
        es.extras["train_pending_data"] = ds
    return ds.summary(es.world_size)


def _data(es, st) -> DataState:
    if st.data is None and "train_pending_data" in es.extras:
        st.data = es.extras.pop("train_pending_data")
    if st.data is None:
        raise TrainError(
            "no dataset chosen: run `%dp data DATASET` "
            "(dpnb.engine.training.set_data(ns, 'DATASET')) first"
        )
    return st.data


# --------------------------------------------------------------------------
# the step


def _to_device(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, dev) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, dev) for k, v in x.items()}
    return x


def _split(batch):
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        for a, b in (("input", "target"), ("x", "y"), ("inputs", "targets")):
            if a in batch and b in batch:
                return batch[a], batch[b]
    raise TrainError(
        "batches are not (input, target) pairs; pass step_fn=your_fn where "
        "your_fn(batch) returns the micro-batch's mean loss"
    )


def default_loss(output, target):
    """MSE for float targets, cross-entropy for integer class/token ids
    (logits ``(..., C)``, targets ``(...)``); computed in float32."""
    if target.dtype.is_floating_point:
        return F.mse_loss(output.float(), target.float())
    logits = output.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _resolve_callable(ns, fn, what):
    if fn is None or callable(fn):
        return fn
    if isinstance(fn, str):
        if fn in ns and callable(ns[fn]):
            return ns[fn]
        raise TrainError(f"there is no function {fn!r} on this rank for {what}; define it in a %%dp cell")
    raise TrainError(f"{what} must be a function or the name of one, got {type(fn).__name__}")


def _arity(fn) -> int:
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(1 for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


class _StopRequest:
    """Turns Ctrl-C (SIGINT) and the Stop button into a flag that the loop
    reads at step boundaries, so no KeyboardInterrupt ever lands inside a
    collective (which would leave the other ranks waiting in it)."""

    def __init__(self, es):
        self.es = es
        self.sigint = False
        self._prev = None
        self._installed = False

    def __enter__(self):
        self.es.extras["stop_requested"] = False
        path = self.es.extras.get("stop_file")
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def _handler(self, signum, frame):
        self.sigint = True

    def __exit__(self, *exc):
        if self._installed:
            prev = self._prev if self._prev is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, prev)
        return False

    def reason(self) -> str | None:
        if self.sigint:
            return "interrupt"
        if self.es.extras.get("stop_requested"):
            return "stop_requested"
        path = self.es.extras.get("stop_file")
        if path and os.path.exists(path):
            return "stop_file"
        return None


def _make_publisher(publish):
    if publish is None or publish is False:
        return None
    if callable(publish):
        return publish
    try:
        from ipyparallel.datapub import publish_data
    except Exception:
        return None
    return publish_data


def _comm_device(es, dev):
    return dev if es.backend == "nccl" else torch.device("cpu")


def train(
    ns: dict,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    micro_batch: int,
    grad_accum: int = 1,
    lr_scale: str = "none",
    ref_batch: int | None = None,
    step_fn=None,
    loss_fn=None,
    seq_len: int | None = None,
    record: bool | None = None,
    publish=None,
) -> dict:
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

    Ctrl-C (SIGINT) or the Stop button (``extras["stop_requested"] = True`` or
    the file ``extras["stop_file"]``) stop all ranks together after the same
    step (the one after the request: the flags travel with a step's stats,
    which each rank reads after finishing the next step); model and optimizer
    keep their state.  ``extras
    ["straggle_delay_s"]`` makes this rank sleep that long in each step.

    ``record`` (default: on) keeps DDP bucket/backward timelines and per-step
    byte counts; step records (see :func:`records`) are always kept.  A step
    record holds ``step`` (global index, continuing across calls), ``epoch``,
    ``loss`` (global mean), ``loss_rank``, ``step_time_s``, ``samples`` =
    ``global_batch``, ``tokens`` (``seq_len`` per sample, from the argument or
    the dataset's ``seq_len``), ``micro_batch``, ``grad_accum``, ``dp``,
    ``lr``, ``samples_per_s``, ``tokens_per_s``, ``t_start``/``t_end``
    (``time.time``), ``straggle_delay_s``, ``bytes`` (:func:`state_bytes`
    right after ``optimizer.step()``, or None when not recording; counted on
    the first and last step of a call and every ``BYTES_EVERY`` steps, the
    steps between carry the last count -- the tensors keep their sizes from
    step to step -- and ``counted_at_step`` says which step it is from) and
    ``compute_s`` / ``compute_s_all`` (this rank's / every rank's): the time
    spent in work that waits for no other rank -- the non-final micro-batches,
    the final forward, the straggle delay and the optimizer step -- so a slow
    rank shows a larger value and the others' ``step_time_s - compute_s`` is
    mostly waiting.  (The final backward, which overlaps the gradient
    all-reduce, is left out; under FSDP forward also all-gathers, and
    ZeRO-1's step includes its parameter broadcast.)
    ``publish=True`` sends progress through ``ipyparallel.datapub`` (at most
    ~5 times a second); a callable receives the same dict.
    """
    es = get_state(ns)
    st = require_bound(ns)
    data = _data(es, st)
    if step_fn is not None and loss_fn is not None:
        raise TrainError("pass either step_fn or loss_fn, not both")
    for nm, v in (("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if not isinstance(v, int) or v < 1:
            raise TrainError(f"{nm} must be a positive integer, got {v!r}")
    if (steps is None) == (epochs is None):
        raise TrainError("give exactly one of --steps S or --epochs E")
    ws, rank = es.world_size, es.rank
    B, K = micro_batch, grad_accum
    G = B * ws * K
    per_rank = data.per_rank_len(ws)
    if per_rank < B * K:
        raise TrainError(
            f"dataset {data.name} has {len(data.dataset)} samples, so each of the "
            f"{ws} ranks gets {per_rank}; one step needs micro_batch x grad_accum = "
            f"{B} x {K} = {B * K} per rank (global batch {B} x {ws} ranks x {K} = {G}). "
            "Use a smaller --micro-batch or --grad-accum, or a larger dataset"
        )
    steps_per_epoch = per_rank // (B * K)
    if steps is not None:
        if not isinstance(steps, int) or steps < 0:
            raise TrainError(f"--steps must be a non-negative integer, got {steps!r}")
        n_steps = steps
    else:
        if not isinstance(epochs, int) or epochs < 0:
            raise TrainError(f"--epochs must be a non-negative integer, got {epochs!r}")
        n_steps = epochs * steps_per_epoch

    # Learning-rate scaling for the larger global batch.
    mode = _choice(lr_scale, LR_SCALES, "lr scaling")
    ref = ref_batch if ref_batch is not None else B
    if ref <= 0:
        raise TrainError(f"--ref-batch must be positive, got {ref}")
    scale = {"none": 1.0, "linear": G / ref, "sqrt": math.sqrt(G / ref)}[mode]
    step_fn = _resolve_callable(ns, step_fn, "step_fn")
    loss_fn = _resolve_callable(ns, loss_fn, "loss_fn")
    step_arity = _arity(step_fn) if step_fn is not None else 0

    # Everything is validated: from here on the call changes state.
    groups = st.optimizer.param_groups
    for g in groups:
        g["lr"] = float(g["lr"]) / st.lr_scale_applied * scale
    st.lr_scale_applied = scale
    lr_now = float(groups[0]["lr"])
    tps = seq_len if seq_len is not None else getattr(data.dataset, "seq_len", None)
    publisher = _make_publisher(publish)
    record = st.record_default if record is None else bool(record)
    rec = st.recorder
    if rec is not None:
        rec.set_enabled(record)
    dev = st.device
    cdev = _comm_device(es, dev)
    fsdp = st.strategy in ("zero2", "zero3")
    autocast = (
        torch.autocast(dev.type, dtype=torch.bfloat16 if st.config["mixed_precision"] == "bf16" else torch.float16)
        if st.config["mixed_precision"] != "none" and not fsdp
        else None
    )
    model, opt, scaler = st.wrapped, st.optimizer, st.scaler
    st.module.train()

    first = st.step
    losses: list = []
    stop_reason = None
    last_pub = 0.0
    # Every publish carries the recent history, not just what is new since
    # the last one: the notebook only sees the latest published dict, and
    # it polls less often than steps may finish.
    pub_hist: deque = deque(maxlen=500)
    t_call = time.perf_counter()
    samples_total = 0

    pending = None
    counted = None  # the last state_bytes count, carried to the steps in between

    def finish(p) -> bool:
        """Complete step ``p``: wait for its gathered stats, check the global
        batch, keep its record, publish progress.  True when a rank asked
        to stop (every rank sees the same flags here, so all stop after the
        same step)."""
        nonlocal last_pub, stop_reason, publisher
        p["work"].wait()
        allst = torch.stack(p["gathered"]).cpu()
        n_global = int(allst[:, 3].sum().item())
        if n_global != G:
            raise TrainError(
                f"global batch check failed at step {p['step']}: ranks processed "
                f"{allst[:, 3].tolist()} samples = {n_global}, expected micro_batch x "
                f"world_size x grad_accum = {B} x {ws} x {K} = {G}"
            )
        gloss = float(allst[:, 0].mean().item())
        dt = p["dt"]
        rec_d = {
            "step": p["step"],
            "epoch": p["epoch"],
            "rank": rank,
            "loss": gloss,
            "loss_rank": float(allst[rank, 0].item()),
            "step_time_s": dt,
            "samples": G,
            "tokens": G * tps if tps else None,
            "global_batch": G,
            "micro_batch": B,
            "grad_accum": K,
            "dp": ws,
            "lr": p["lr"],
            "compute_s": p["compute"],
            "compute_s_all": allst[:, 2].tolist(),
            "straggle_delay_s": p["delay"],
            "samples_per_s": G / dt if dt > 0 else None,
            "tokens_per_s": G * tps / dt if (tps and dt > 0) else None,
            "t_start": p["wall0"],
            "t_end": p["t_end"],
            "strategy": st.strategy,
            "bytes": p["bytes"],
        }
        st.records.append(rec_d)
        losses.append(gloss)
        stopping = bool(allst[:, 1].max() > 0)
        if publisher is not None:
            pub_hist.append((p["step"], gloss))
            now = time.perf_counter()
            if now - last_pub >= 0.2 or p["i"] == n_steps - 1 or stopping:
                payload = {
                    "dpnb_progress": {
                        "rank": rank,
                        "step": p["step"],
                        "done": p["i"] + 1,
                        "total": n_steps,
                        "loss": gloss,
                        "samples_per_s": rec_d["samples_per_s"],
                        "tokens_per_s": rec_d["tokens_per_s"],
                        "step_time_s": dt,
                        "compute_s_all": rec_d["compute_s_all"],
                        "history": list(pub_hist),
                    }
                }
                try:
                    publisher(payload)
                except Exception:
                    publisher = None  # not inside an engine; keep training
                last_pub = now
        if stopping and stop_reason is None:
            stop_reason = p["stop_local"] or stop.reason() or "stopped_by_other_rank"
        return stopping

    with _StopRequest(es) as stop:
        for i in range(n_steps):
            data.ensure_room(B * K, rank, ws)
            step_idx = st.step
            if record and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            wall0 = time.time()
            t0 = time.perf_counter()
            if rec is not None:
                rec.begin_step(step_idx, origin=wall0)
            compute = 0.0
            n_local = 0
            loss_acc = torch.zeros((), dtype=torch.float64, device=dev)
            delay = float(es.extras.get("straggle_delay_s") or 0.0)
            for k in range(K):
                last = k == K - 1
                batch, n = data.micro_batch(k, B, rank, ws)
                n_local += n
                batch = _to_device(batch, dev)
                tc = time.perf_counter()
                if last and delay > 0:
                    time.sleep(delay)  # a simulated slow rank: others wait in the sync
                if rec is not None:
                    rec.micro = k
                if fsdp:
                    model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext() if (last or fsdp) else model.no_sync()
                with sync:
                    with autocast if autocast is not None else contextlib.nullcontext():
                        if step_fn is not None:
                            loss = step_fn(model, batch) if step_arity >= 2 else step_fn(batch)
                        else:
                            x, y = _split(batch)
                            out = model(x)
                            loss = (loss_fn or default_loss)(out, y)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise TrainError(
                            "the loss must be a scalar tensor (the micro-batch mean), got "
                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
                        )
                    scaled = loss.reshape(()) / K
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
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
                loss_acc += loss.detach().reshape(()).to(torch.float64)
            tc = time.perf_counter()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            nbytes = None
            if record:
                if counted is None or i == n_steps - 1 or i % BYTES_EVERY == 0:
                    counted = dict(state_bytes(st.module, opt, dev), counted_at_step=step_idx)
                    nbytes = counted
                else:
                    nbytes = dict(counted)
                    if dev.type == "cuda":  # the peak is per step, and cheap to read
                        nbytes["peak_allocated"] = int(torch.cuda.max_memory_allocated(dev))
                        nbytes["allocated"] = int(torch.cuda.memory_allocated(dev))
            opt.zero_grad(set_to_none=True)
            compute += time.perf_counter() - tc

            stop_local = stop.reason()
            stats = torch.stack(
                [
                    (loss_acc / K).to(cdev),
                    torch.tensor(1.0 if stop_local else 0.0, dtype=torch.float64, device=cdev),
                    torch.tensor(compute, dtype=torch.float64, device=cdev),
                    torch.tensor(float(n_local), dtype=torch.float64, device=cdev),
                ]
            )
            gathered = [torch.empty_like(stats) for _ in range(ws)]
            # Started now, waited for after the *next* step: by then every
            # rank has long sent its part (they all passed through that
            # step's gradient sync), so the wait is free.  A blocking
            # all_gather here would add a barrier per step, and on a busy
            # machine every barrier costs the ranks' jitter (measured: +3-5
            # ms per 25 ms step on 2 CPU ranks).
            work = dist.all_gather(gathered, stats, async_op=True)
            if dev.type == "cuda":
                # the step's kernels, not just their launches, belong in its time
                torch.cuda.current_stream(dev).synchronize()
            t1 = time.perf_counter()
            if rec is not None:
                rec.end_step()
            issued = {
                "work": work, "gathered": gathered, "step": step_idx, "epoch": data.epoch,
                "dt": t1 - t0, "wall0": wall0, "t_end": time.time(), "compute": compute,
                "delay": delay, "bytes": nbytes, "lr": float(groups[0]["lr"]), "i": i,
                "stop_local": stop_local,
            }
            data.offset += G
            st.step += 1
            samples_total += G
            if pending is not None and finish(pending):
                pending = issued
                break
            pending = issued
        if pending is not None:
            finish(pending)

    wall = time.perf_counter() - t_call
    done = st.step - first
    return {
        "rank": rank,
        "strategy": st.strategy,
        "steps": done,
        "requested_steps": n_steps,
        "first_step": first,
        "last_step": st.step - 1 if done else None,
        "interrupted": stop_reason is not None,
        "stop_reason": stop_reason,
        "loss": losses[-1] if losses else None,
        "losses": losses,
        "global_batch": G,
        "micro_batch": B,
        "grad_accum": K,
        "dp": ws,
        "lr": lr_now,
        "lr_scale": mode,
        "steps_per_epoch": steps_per_epoch,
        "epoch": data.epoch,
        "time_s": wall,
        "samples_per_s": samples_total / wall if wall > 0 else None,
        "tokens_per_s": samples_total * tps / wall if (tps and wall > 0) else None,
    }


# --------------------------------------------------------------------------
# records


def records(ns: dict, since_step: int | None = None, last: int | None = None) -> list:
    """Per-step records on this rank (dicts of builtins; see ``train``)."""
    st = train_state(ns)
    out = [r for r in st.records if since_step is None or r["step"] >= since_step]
    if last is not None:
        out = out[-last:]
    return [dict(r) for r in out]


def clear_records(ns: dict) -> None:
    st = train_state(ns)
    st.records.clear()
    if st.recorder is not None:
        st.recorder.steps.clear()


def set_recording(ns: dict, on: bool) -> dict:
    """Default for ``train(record=None)``: bucket timelines and byte counts."""
    st = train_state(ns)
    st.record_default = bool(on)
    if st.recorder is not None:
        st.recorder.set_enabled(on)
    return {"recording": st.record_default}


# --------------------------------------------------------------------------
# re-binding after the process group is re-formed


def _fsdp_mesh_infos(module: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    infos: dict = {}
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        for pg in getattr(state, "_fsdp_param_groups", []) or []:
            cands = [pg.mesh_info, pg.post_forward_mesh_info]
            for fp in pg.fsdp_params:
                cands += [getattr(fp, "mesh_info", None), getattr(fp, "post_forward_mesh_info", None)]
            for info in cands:
                if info is not None:
                    infos[id(info)] = info
    return list(infos.values())


def _rebind_fsdp(st: TrainState, es) -> None:
    """Point the existing FSDP2 state at the new default group, in place.

    FSDP2's DTensor parameters, their optimizer state and every FSDP param
    group refer to one ``DeviceMesh`` object; the mesh names its process
    group, and FSDP's mesh-info objects cache the group object itself.  We
    build a fresh mesh on the new group (collective), copy its group names
    into the existing mesh object, and recompute the cached groups.  Shards,
    parameter objects and optimizer state are untouched.  Requires the same
    world size (the shards' layout depends on it).
    """
    from torch.distributed.device_mesh import init_device_mesh

    fresh = init_device_mesh(st.device.type, (es.world_size,))
    infos = _fsdp_mesh_infos(st.module)
    meshes = {id(i.mesh): i.mesh for i in infos}
    if st.mesh is not None:
        meshes[id(st.mesh)] = st.mesh
    for mesh in meshes.values():
        mesh._dim_group_names = list(fresh._dim_group_names)
        reg = getattr(mesh, "_pg_registry", None)
        if isinstance(reg, dict):
            reg.clear()
            reg.update(getattr(fresh, "_pg_registry", {}) or {})
    for info in infos:
        info.__post_init__()
    reset = getattr(st.wrapped, "reset_iter_state", None)
    if reset is not None:
        reset()


def rebind(ns: dict) -> dict:
    """Re-bind the wrapped model and optimizer to the current default group.

    Called by the ``on_reform`` callback after the group was destroyed and
    re-formed.  Collective on the new group: every rank must call it.  Parameters and optimizer state survive and
    the optimizer keeps the same parameter objects:

    * ddp/zero1: the old DDP's autograd hooks are removed and a new
      ``DistributedDataParallel`` is built around the same module (it
      broadcasts rank 0's parameters, which all ranks already share); the comm
      hook is re-registered; ``ZeroRedundancyOptimizer`` is pointed at the new
      group (its partition depends only on the world size, which must not
      change).
    * zero2/zero3: see :func:`_rebind_fsdp` (same world size required).

    The step that was cut short by the error is discarded (gradients zeroed);
    its samples are read again by the next ``train``.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    es = get_state(ns)
    st = train_state(ns)
    if st.generation == es.generation:
        return {"rebound": False, "generation": es.generation}
    if es.world_size != st.world_size and st.strategy != "ddp":
        raise TrainError(
            f"the group was re-formed with {es.world_size} ranks instead of "
            f"{st.world_size}; {st.strategy} partitions state by world size, so "
            "save a checkpoint before, then wrap a fresh model and load it"
        )
    if st.strategy in ("ddp", "zero1"):
        old = st.wrapped
        remove = getattr(old, "_remove_autograd_hooks", None)
        if remove is not None:
            with contextlib.suppress(Exception):
                remove()
        st.wrapped = DDP(st.module, **st.ddp_kwargs)
        if st.recorder is not None:
            st.recorder.attach(st.wrapped)
        if st.strategy == "zero1":
            zo = st.optimizer
            zo.process_group = dist.group.WORLD
            zo.world_size = dist.get_world_size(zo.process_group)
            zo.rank = dist.get_rank(zo.process_group)
            zo.global_rank = dist.distributed_c10d.get_global_rank(zo.process_group, zo.rank)
        ns[st.model_out] = st.wrapped
        if st.model_name == st.model_out:
            pass  # the original module stays reachable as ns[model_out].module
    else:
        _rebind_fsdp(st, es)
    st.optimizer.zero_grad(set_to_none=True)
    st.generation = es.generation
    st.world_size = es.world_size
    return {"rebound": True, "generation": es.generation, "strategy": st.strategy}


def _on_reform(ns: dict, state) -> None:
    """``EngineState.on_reform`` callback registered by :func:`wrap`."""
    if state.extras.get(TRAIN_KEY) is not None:
        rebind(ns)
