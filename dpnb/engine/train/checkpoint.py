"""``%dp save DIR`` / ``%dp load DIR`` / ``%dp pull-model``.

Checkpoints use ``torch.distributed.checkpoint`` (DCP): every rank writes the
tensors it holds (DDP replicas are de-duplicated, FSDP shards and ZeRO-1
optimizer partitions are written by their owners) into ``DIR`` plus a
global ``.metadata`` index, and on load every rank reads exactly the slices
its *current* layout needs.  That is what makes a checkpoint loadable under a
different strategy or world size: the state is keyed by parameter name
(``get_state_dict`` / ``set_state_dict`` from
``torch.distributed.checkpoint.state_dict`` turn DDP/FSDP2 objects into and
from that form), never by rank.  ``DIR`` must be one directory that all ranks
see (a shared filesystem when ranks span machines).

Only tensors go into DCP; everything else (step, data position, wrap config,
optimizer hyper-parameters) goes into ``DIR/dpnb.json``.  Loading never
unpickles arbitrary objects: tensor data is read with ``torch.load(...,
weights_only=True)`` (DCP's own reader), DCP's ``.metadata`` index is read
with an unpickler that accepts only DCP's metadata classes and torch
dtypes/sizes, and non-tensor DCP entries are refused.

ZeroRedundancyOptimizer keeps each parameter's state on one rank and its
``state_dict()`` needs a consolidation onto one rank first; instead this
module writes each rank's partition under the same parameter-name keys that
a plain optimizer uses (``optim.state.<param>.<key>``), so a ZeRO-1
checkpoint loads into DDP or FSDP and vice versa, and nothing is gathered.
"""

from __future__ import annotations

import builtins
import collections
import errno
import io
import json
import os
import pathlib
import pickle
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dpnb import compat
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import TrainError, require_bound

__all__ = ["save", "load", "full_state_dict", "read_meta", "SafeFileSystemReader"]

META_FILE = "dpnb.json"
FORMAT = "dpnb-dcp-1"
_HYPER = ("lr", "betas", "weight_decay", "momentum", "eps", "dampening", "nesterov", "amsgrad")


# --------------------------------------------------------------------------
# safe reading


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
            "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        # rebuilds a torch.layout from its name (how torch pickles layouts)
        "torch.serialization": {"_get_layout"},
    }
    _BUILTINS = {"set", "frozenset", "list", "dict", "tuple", "int", "float", "str", "bytes", "bool", "complex", "slice"}

    def find_class(self, module: str, name: str):
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if module == "builtins" and name in self._BUILTINS:
            return getattr(builtins, name)
        if module == "collections" and name in ("OrderedDict", "defaultdict"):
            return getattr(collections, name)
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a checkpoint's .metadata "
            "(only DCP metadata classes are allowed)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose ``.metadata`` is read with an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise RuntimeError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
            "dpnb checkpoints hold tensors only and do not unpickle objects"
        )


# --------------------------------------------------------------------------
# optimizer state in parameter-name form


def _zero_inner(st):
    return compat.zero_inner_optimizer(st.optimizer) if st.strategy == "zero1" else st.optimizer


def _param_names(st) -> dict:
    return {id(p): n for n, p in st.module.named_parameters()}


def _has_state(opt) -> bool:
    return any(len(s) for s in opt.state.values())


def _materialize_state(opt) -> None:
    """Create optimizer state (zeros) by one step with zero grads and lr 0,
    so that a checkpoint can be loaded into it in place."""
    if _has_state(opt):
        return
    saved = []
    for g in opt.param_groups:
        saved.append(g["lr"])
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _zero1_optim_state(st) -> dict:
    names = _param_names(st)
    inner = compat.zero_inner_optimizer(st.optimizer)
    out = {}
    for p, s in inner.state.items():
        ts = {k: v for k, v in s.items() if isinstance(v, torch.Tensor)}
        if ts:
            out[names[id(p)]] = ts
    return out


def _optim_tensors(osd_state: dict) -> dict:
    return {
        fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)}
        for fqn, s in osd_state.items()
    }


def _hyper(opt) -> list:
    return [
        {k: (list(v) if isinstance(v, tuple) else (float(v) if isinstance(v, torch.Tensor) else v))
         for k, v in g.items() if k in _HYPER}
        for g in opt.param_groups
    ]


# --------------------------------------------------------------------------
# API


def save(ns: dict, path: str) -> dict:
    """Write model + optimizer state + step to ``path`` (collective).

    Every rank writes its own tensors; rank 0 also writes ``dpnb.json``.
    Optimizer state is saved only once it exists (after a first step) --
    before that the checkpoint holds the model alone.
    """

    es = get_state(ns)
    st = require_bound(ns)
    path = os.path.abspath(os.path.expanduser(str(path)))
    created = not os.path.exists(path)  # a failed save removes only a folder it made
    os.makedirs(path, exist_ok=True)
    msd = get_model_state_dict(st.wrapped)
    inner = _zero_inner(st)
    # all ranks must agree on whether optimizer state is part of the save; a
    # ZeRO-1 rank that owns no parameter has nothing to add and agrees
    owned = [p for g in inner.param_groups for p in g["params"]]
    # on the communication device: an NCCL group reduces GPU tensors only
    # ... and, in the same all_reduce, whether any rank made the folder (the
    # others may have found it there a moment later): a failed save removes it
    # on every rank alike, and says so in one sentence
    has = torch.tensor([1 if (_has_state(inner) or not owned) else 0, 0 if created else 1],
                       device=es.comm_device)
    dist.all_reduce(has, op=dist.ReduceOp.MIN)
    with_optim, created = bool(has[0].item()), not bool(has[1].item())
    sd: dict = {"model": msd}
    if with_optim:
        if st.strategy == "zero1":
            sd["optim"] = _zero1_optim_state(st)
        else:
            osd = get_optimizer_state_dict(st.wrapped, st.optimizer)
            sd["optim"] = _optim_tensors(osd["state"])
    try:
        # DCP gathers every rank's write errors and raises on all of them alike:
        # no rank is left waiting in a collective of the save
        dcp.save(sd, storage_writer=FileSystemWriter(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise _not_written(path, e, created) from None
    meta = {
        "format": FORMAT,
        "step": st.step,
        "strategy": st.strategy,
        "world_size": es.world_size,
        "wrap_config": st.config,
        "optimizer": st.config["optimizer"],
        "has_optimizer_state": with_optim,
        "param_groups": _hyper(st.optimizer),
        "lr_scale_applied": st.lr_scale_applied,
        "model_keys": sorted(msd.keys()),
        "data": None,
    }
    if st.data is not None:
        meta["data"] = {
            "name": st.data.name,
            "len": len(st.data.dataset),
            "seed": st.data.seed,
            "shuffle": st.data.shuffle,
            "epoch": st.data.epoch,
            "offset": st.data.offset,
        }
    failed: OSError | None = None
    if es.rank == 0:
        tmp = os.path.join(path, META_FILE + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1)
            os.replace(tmp, os.path.join(path, META_FILE))
        except OSError as e:  # told to every rank below, so none waits for rank 0
            failed = e
    # the barrier that ends the save carries rank 0's word: all raise alike, or none
    ok = torch.tensor([0 if failed is not None else 1], device=es.comm_device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise _not_written(path, failed or OSError(f"rank 0 could not write {META_FILE}"),
                           created)
    return {"rank": es.rank, "path": path, "step": st.step, "strategy": st.strategy,
            "optimizer_state": with_optim, "n_model_tensors": len(msd)}


class CheckpointWriteError(TrainError):
    """A checkpoint that could not be written (a full disk, a folder gone)."""


def _not_written(path: str, e: BaseException, created: bool) -> CheckpointWriteError:
    """One line for a save that failed on every rank; the partial folder removed
    when this save made it (a folder that was there before is left as it was)."""
    text = str(e)
    # DCP hands every rank the same table of the ranks' failures, so each decides
    # alike; torch.save's zip writer may fail first, on the short write itself
    texts = [text] + [str(x) for x in (getattr(e, "failures", None) or {}).values()]
    if getattr(e, "errno", None) == errno.ENOSPC or any("No space left on device" in t
                                                        for t in texts):
        full = "No space left on device"
    elif any("unexpected pos" in t for t in texts):
        full = "a write came up short: no space left, or a quota"
    else:
        full = ""
    if created:
        shutil.rmtree(path, ignore_errors=True)
    gone = "; the partial folder was removed" if created else ""
    if full:  # (no free-space figure: read on each rank at another moment, it would differ)
        return CheckpointWriteError(
            f"checkpoint not written: {os.path.dirname(path)} is out of space ({full})"
            f"{gone}; free space there or save to another folder")
    first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return CheckpointWriteError(f"checkpoint not written to {path}: {type(e).__name__}: "
                                f"{first[:300]}{gone}")


def read_meta(path: str) -> dict:
    p = os.path.join(os.path.abspath(os.path.expanduser(str(path))), META_FILE)
    if not os.path.exists(p):
        raise FileNotFoundError(
            f"{path} is not a dpnb checkpoint (no {META_FILE}); save one with `%dp save DIR`"
        )
    with open(p) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def load(ns: dict, path: str, *, optimizer: bool = True, data_position: bool = True) -> dict:
    """Load ``path`` into the currently wrapped model/optimizer (collective).

    Works across strategies and world sizes: each rank asks DCP for the
    tensors of its current layout (whole tensors for DDP, its shards for
    FSDP, its owned parameters' state for ZeRO-1) and DCP reads the matching
    slices from whatever layout wrote them.  Restores the step counter, the
    optimizer hyper-parameters and (with ``data_position``) the dataset
    epoch/position, so training continues where it stopped.
    """

    es = get_state(ns)
    st = require_bound(ns)
    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        meta = read_meta(path)
    except (FileNotFoundError, ValueError) as e:
        raise TrainError(str(e)) from None
    reader = SafeFileSystemReader(path)
    ck_keys = set(reader.read_metadata().state_dict_metadata.keys())

    msd = get_model_state_dict(st.wrapped)
    missing = sorted(f"model.{k}" for k in msd if f"model.{k}" not in ck_keys)
    if missing:
        raise TrainError(
            f"the checkpoint lacks {len(missing)} of this model's tensors, e.g. "
            f"{missing[:5]}; it was saved from a different model"
        )
    sd: dict = {"model": msd}
    want_optim = optimizer and meta.get("has_optimizer_state")
    if want_optim and meta.get("optimizer") != st.config["optimizer"]:
        raise TrainError(
            f"the checkpoint's optimizer is {meta.get('optimizer')} but this model's is "
            f"{st.config['optimizer']}; wrap with --optimizer {meta.get('optimizer')} or "
            "load with optimizer=False"
        )
    osd = None
    if want_optim:
        inner = _zero_inner(st)
        _materialize_state(inner)
        if st.strategy == "zero1":
            sd["optim"] = _zero1_optim_state(st)
        else:
            osd = get_optimizer_state_dict(st.wrapped, st.optimizer)
            sd["optim"] = _optim_tensors(osd["state"])
        flat_missing = [
            f"optim.{fqn}.{k}" for fqn, s in sd["optim"].items() for k in s
            if f"optim.{fqn}.{k}" not in ck_keys
        ]
        if flat_missing:
            raise TrainError(
                f"the checkpoint lacks optimizer state {flat_missing[:5]}; load with "
                "optimizer=False to take the model only"
            )
    dcp.load(sd, storage_reader=reader, planner=_TensorOnlyLoadPlanner())
    # DCP filled the tensors in place; set_*_state_dict also handles layouts
    # where get_state_dict returned copies.
    set_model_state_dict(st.wrapped, sd["model"])
    if osd is not None:
        for fqn, s in sd["optim"].items():
            osd["state"][fqn].update(s)
        set_optimizer_state_dict(st.wrapped, st.optimizer, osd)
    if want_optim:
        for g, h in zip(st.optimizer.param_groups, meta.get("param_groups") or []):
            for k, v in h.items():
                if k in g:
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v
        st.lr_scale_applied = float(meta.get("lr_scale_applied", 1.0))
    st.step = int(meta["step"])
    notes = []
    dmeta = meta.get("data")
    if data_position and dmeta:
        if st.data is None:
            notes.append("no dataset chosen yet: the data position was not restored")
        elif len(st.data.dataset) != dmeta["len"]:
            notes.append(
                f"dataset length {len(st.data.dataset)} differs from the checkpoint's "
                f"{dmeta['len']}: the data position was not restored"
            )
        else:
            st.data.seed = dmeta["seed"]
            st.data.shuffle = dmeta["shuffle"]
            st.data.epoch = dmeta["epoch"]
            st.data.offset = dmeta["offset"]
            st.data._key = None
            if st.data.offset % es.world_size:
                notes.append(
                    f"the saved position {st.data.offset} is not a multiple of "
                    f"{es.world_size} ranks; rounded down"
                )
    dist.barrier()
    return {
        "rank": es.rank,
        "path": path,
        "step": st.step,
        "saved_strategy": meta["strategy"],
        "saved_world_size": meta["world_size"],
        "strategy": st.strategy,
        "world_size": es.world_size,
        "optimizer_state": bool(want_optim),
        "notes": notes,
    }


def full_state_dict(ns: dict) -> dict:
    """The full, unwrapped model state dict on rank 0 (``{}`` elsewhere).

    Collective for FSDP (every parameter is all-gathered); keys are the
    original module's parameter names (no ``module.`` prefix), values are
    CPU tensors not shared with the live model."""

    es = get_state(ns)
    st = require_bound(ns)
    sd = get_model_state_dict(
        st.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if es.rank != 0:
        return {}
    return {k: v.detach().to("cpu").clone() for k, v in sd.items()}
