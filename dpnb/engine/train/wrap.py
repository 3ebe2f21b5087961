"""Wrapping a model on every rank: DDP, ZeRO-1, FSDP2 (ZeRO-2/3), and re-binding after a re-form.

Who communicates what, strategy by strategy:

``ddp``
    ``DistributedDataParallel`` broadcasts rank 0's parameters and buffers
    once, here; during the backward of a step's last micro-batch it
    all-reduces gradients bucket by bucket, each bucket as soon as it is
    ready, overlapping the rest of backward.
``zero1``
    The same DDP plus ``ZeroRedundancyOptimizer``: each rank keeps optimizer
    state for the whole parameters assigned to it and broadcasts them after
    its step.
``zero2`` / ``zero3``
    FSDP2 ``fully_shard`` per unit (innermost first, the root last) with
    ``reshard_after_forward`` False / True.  This module broadcasts rank 0's
    weights first (FSDP2 shards whatever each rank holds); forward all-gathers
    each unit, backward reduce-scatters its gradients.

Every function here is collective: all ranks call it at once.  The old
wrapper of a re-wrapped model is released only after the new one is built.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from dpnb import compat
from dpnb.core.strategies import (
    MIXED_PRECISION,
    OPTIMIZERS,
    STRATEGIES,
    comm_hook_label,
    is_ddp,
    is_fsdp,
    parse_comm_hook,
)
from dpnb.engine import device
from dpnb.engine.train.commhook import CommHook
from dpnb.engine.train.measure import BucketRecorder, local_tensor
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import TrainError, TrainState, choice, train_state

log = logging.getLogger(__name__)


def _module_names(ns: dict) -> list:
    return sorted(k for k, v in ns.items() if isinstance(v, nn.Module) and not k.startswith("_"))


def _resolve_model(ns: dict, model_name: str, rank: int) -> nn.Module:
    # lazy: FSDP/DTensor load only for the strategy that uses them
    from torch.distributed.fsdp import FSDPModule

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
        # lazy: only zero1 loads torch.distributed.optim
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
    compat.remove_ddp_hooks(st.wrapped)


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
    comm_hook: str = "none",
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

    ``comm_hook`` (ddp/zero1): how DDP sends each bucket -- ``none`` (its
    averaging all-reduce), ``fp16`` / ``bf16`` (cast to 16 bits: half the
    bytes), ``powersgd[:R]`` (rank-R factors of each gradient matrix); see
    :mod:`dpnb.engine.train.commhook`.  Every rank sends alike, so the replicas
    stay identical.
    """
    es = get_state(ns)
    strategy = choice(strategy, STRATEGIES, "strategy")
    mp = choice(mixed_precision, MIXED_PRECISION, "mixed precision")
    opt_name = choice(optimizer, OPTIMIZERS, "optimizer")
    dev = torch.device(es.device)
    _check_wrap_args(es, dev, strategy, mp, cpu_offload, bucket_cap_mb)
    hook_kind, _ = parse_comm_hook(comm_hook)
    if hook_kind != "none" and not is_ddp(strategy):
        raise TrainError(f"--comm-hook {comm_hook} applies to DDP's gradient buckets (ddp, zero1); "
                         f"{strategy} reduce-scatters in FSDP's own dtype: use --mixed-precision")
    module = _resolve_model(ns, model_name, es.rank)
    if not dist.is_initialized():
        raise TrainError(
            "torch.distributed is not initialized on this engine: start the "
            "cluster with dpnb.start() before wrapping"
        )
    device.set_device(dev)
    module.to(dev)
    if is_ddp(strategy):
        wrapped, recorder, ddp_kwargs = _wrap_ddp(module, dev, bucket_cap_mb, record_buckets,
                                                  comm_hook)
        mesh, units, notes = None, [], []
    else:
        wrapped, mesh, units, notes = _wrap_fsdp(module, dev, es.world_size, strategy, mp,
                                                 cpu_offload, wrap_classes, bucket_cap_mb)
        recorder, ddp_kwargs = None, {}
    opt = _build_optimizer(strategy, list(module.parameters()), opt_name, lr, weight_decay,
                           momentum, betas)
    st = TrainState(
        strategy=strategy,
        config=_wrap_config(strategy, bucket_cap_mb, mp, cpu_offload, wrap_classes, opt_name,
                            lr, weight_decay, momentum, betas, comm_hook_label(comm_hook)),
        model_name=model_name, model_out=model_out, optimizer_out=optimizer_out,
        module=module, wrapped=wrapped, optimizer=opt, world_size=es.world_size,
        generation=es.generation, device=dev, mesh=mesh, recorder=recorder,
        scaler=device.grad_scaler(dev, mesh.get_group() if mesh is not None else None)
        if mp == "fp16" else None, ddp_kwargs=ddp_kwargs,
    )
    # The new wrapper exists: only now let go of the old one.
    old = es.train
    if old is not None:
        _release(old)
        if old.data is not None:  # a dataset chosen before this wrap keeps its position
            st.data = old.data
    es.train = st
    # once per engine, even if this module was reloaded since
    if not any(getattr(cb, "__qualname__", None) == "_on_reform"
               and getattr(cb, "__module__", None) == __name__ for cb in es.on_reform):
        es.on_reform.append(_on_reform)
    ns[model_out] = wrapped
    ns[optimizer_out] = opt
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
        "n_params": int(sum(p.numel() for p in module.parameters())),
        "n_tensors": len(list(module.parameters())),
        "local_param_numel": int(sum(local_tensor(p).numel() for p in module.parameters())),
        "mixed_precision": mp,
        "bucket_cap_mb": bucket_cap_mb,
        "comm_hook": comm_hook_label(comm_hook),
        "fsdp_units": units,
        "notes": notes,
    }


def _check_wrap_args(es, dev, strategy, mp, cpu_offload, bucket_cap_mb) -> None:
    if mp == "fp16" and not device.is_accel(dev):
        raise TrainError(
            f"--mixed-precision fp16 needs CUDA or another GPU (loss scaling, fp16 kernels); rank "
            f"{es.rank} runs on {dev.type}. Use --mixed-precision bf16 or none"
        )
    if cpu_offload and not is_fsdp(strategy):
        raise TrainError(
            f"--cpu-offload applies to the FSDP strategies zero2/zero3, not {strategy}"
        )
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise TrainError(f"--bucket-cap-mb must be > 0, got {bucket_cap_mb}")


def _wrap_ddp(module: nn.Module, dev, bucket_cap_mb, record_buckets: bool, comm_hook: str):
    """DDP around ``module`` (collective: broadcasts rank 0's parameters)."""

    ddp_kwargs: dict = {
        "device_ids": device.ddp_device_ids(dev),
        "gradient_as_bucket_view": True,
    }
    if bucket_cap_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
    wrapped = DDP(module, **ddp_kwargs)
    recorder = BucketRecorder(module, dev) if record_buckets else None
    _attach_comm_hook(wrapped, recorder, comm_hook)
    return wrapped, recorder, ddp_kwargs


def _attach_comm_hook(wrapped, recorder: BucketRecorder | None, spec: str) -> None:
    """DDP's one comm hook, on a new DDP wrapper: the recorder's, which sends
    each bucket through a fresh :class:`CommHook` (a new DDP starts again from
    its construction-time buckets, and PowerSGD keeps its error feedback per
    bucket), or the bare compression hook, or DDP's own default."""

    hook = CommHook(spec)
    if recorder is not None:
        recorder.hook = hook
        recorder.attach(wrapped)
    elif hook.kind != "none":
        hook.register(wrapped)


def _wrap_fsdp(module: nn.Module, dev, world_size: int, strategy: str, mp: str, cpu_offload,
               wrap_classes, bucket_cap_mb):
    """FSDP2 ``fully_shard`` per unit, then the root (collective: broadcast, mesh)."""
    # lazy: FSDP/DTensor load only for the strategy that uses them
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    notes: list[str] = []
    units = fsdp_units(module, wrap_classes)  # validate before any collective
    _broadcast_from_rank0(module)
    mesh = init_device_mesh(dev.type, (world_size,))
    kw: dict = {"mesh": mesh, "reshard_after_forward": strategy == "zero3"}
    if mp != "none":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if mp == "bf16" else torch.float16,
            reduce_dtype=torch.float32,
        )
    if cpu_offload:
        if device.is_accel(dev):
            kw["offload_policy"] = CPUOffloadPolicy()
        else:
            notes.append("cpu_offload ignored: the ranks already run on CPU")
    mods = dict(module.named_modules())
    for name in units:
        fully_shard(mods[name], **kw)
    fully_shard(module, **kw)
    if bucket_cap_mb is not None:
        notes.append("bucket_cap_mb applies to DDP buckets; FSDP communicates per unit")
    return module, mesh, units, notes


def _wrap_config(strategy, bucket_cap_mb, mp, cpu_offload, wrap_classes, opt_name, lr,
                 weight_decay, momentum, betas, comm_hook="none") -> dict:
    """The wrap's arguments as builtins, for checkpoints and re-binding."""
    classes = [wrap_classes] if isinstance(wrap_classes, (str, type)) else (wrap_classes or [])
    return {
        "strategy": strategy,
        "bucket_cap_mb": bucket_cap_mb,
        "mixed_precision": mp,
        "cpu_offload": bool(cpu_offload),
        "wrap_classes": [w if isinstance(w, str) else w.__name__ for w in classes],
        "optimizer": opt_name,
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "betas": list(betas) if betas else None,
        "comm_hook": comm_hook,
    }



# --------------------------------------------------------------------------
# re-binding after the process group is re-formed


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

    fresh = init_device_mesh(st.device.type, (es.world_size,))
    infos = compat.fsdp_mesh_infos(st.module)
    meshes = {id(i.mesh): i.mesh for i in infos}
    if st.mesh is not None:
        meshes[id(st.mesh)] = st.mesh
    for mesh in meshes.values():
        compat.rebind_mesh(mesh, fresh)
    for info in infos:
        compat.refresh_mesh_info(info)
    reset = getattr(st.wrapped, "reset_iter_state", None)
    if reset is not None:
        try:
            reset()
        except AttributeError as e:  # no forward yet: FSDP's lazy state is not built
            log.info("FSDP has no iteration state to reset (not run since the wrap): %s", e)
    if st.scaler is not None and hasattr(st.scaler, "process_group"):  # fp16: agree on overflow
        st.scaler.process_group = st.mesh.get_group()


def rebind(ns: dict) -> dict:
    """Re-bind the wrapped model and optimizer to the current default group.

    Called by the ``on_reform`` callback after the group was destroyed and
    re-formed.  Collective on the new group: every rank must call it.
    Parameters and optimizer state survive and the optimizer keeps the same
    parameter objects:

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
    if is_ddp(st.strategy):
        old = st.wrapped
        compat.remove_ddp_hooks(old)
        st.wrapped = DDP(st.module, **st.ddp_kwargs)
        _attach_comm_hook(st.wrapped, st.recorder, st.config.get("comm_hook", "none"))
        if st.strategy == "zero1":
            compat.point_zero_at_group(st.optimizer, dist.group.WORLD)
        ns[st.model_out] = st.wrapped  # the module stays reachable as its .module
    else:
        _rebind_fsdp(st, es)
    st.optimizer.zero_grad(set_to_none=True)
    st.generation = es.generation
    st.world_size = es.world_size
    return {"rebound": True, "generation": es.generation, "strategy": st.strategy}


def _on_reform(ns: dict, state) -> None:
    """``EngineState.on_reform`` callback registered by :func:`wrap`."""
    if state.train is not None:
        rebind(ns)
