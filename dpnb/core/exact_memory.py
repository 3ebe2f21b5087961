"""Exact per-rank bytes of model states, for a concrete parameter list.

Where :mod:`dpnb.core.memory` gives the ZeRO paper's per-parameter
arithmetic, this module counts what the PyTorch objects of each strategy hold
on one rank -- DDP's full copies, ``ZeroRedundancyOptimizer``'s greedy
partition of whole parameters, FSDP2's padded dim-0 shards -- so the
prediction can be compared with bytes measured on the ranks.  Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpnb.core.errors import ConfigError
from dpnb.core.memory import MODELED_OPTIMIZERS, OptimizerName, Strategy, _check_choice, _check_pos_int
from dpnb.core.strategies import STRATEGIES, is_ddp
from dpnb.core.units import dtype_bytes


# ---------------------------------------------------------------------------
# Exact mode: what the PyTorch objects hold for a concrete parameter list.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: name, shape, dtype name (e.g. ``"float32"``), trainable flag."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    requires_grad: bool = True

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ConfigError(f"parameter {self.name!r}: shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", self.dtype.removeprefix("torch."))
        dtype_bytes(self.dtype)  # validates the name

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-dim tensor)."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        """numel × itemsize."""
        return self.numel * self.itemsize

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (product of shape[1:])."""
        return math.prod(self.shape[1:])


def param_specs(named_parameters: Iterable[tuple[str, Any]]) -> list[ParamSpec]:
    """ParamSpecs from ``model.named_parameters()`` without importing torch.

    Reads ``.shape``, ``.dtype`` and ``.requires_grad`` by duck typing, so
    core stays torch-free while callers can pass real tensors.
    """
    return [
        ParamSpec(name, tuple(int(d) for d in p.shape), str(p.dtype), bool(getattr(p, "requires_grad", True)))
        for name, p in named_parameters
    ]


def zero1_partition(
    params: Sequence[ParamSpec],
    world_size: int,
    param_groups: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Parameter indices each rank owns under ``ZeroRedundancyOptimizer``.

    Replicates ``ZeroRedundancyOptimizer._partition_parameters``
    (``torch/distributed/optim/zero_redundancy_optimizer.py``): for each param
    group in order, sort its parameters by ``numel`` descending (Python's
    stable sort, so ties keep group order) and give each, whole, to the rank
    with the smallest running element count (``_get_min_index``: the lowest
    rank among ties).  The running counts are *not* reset between groups, and
    they count elements, not bytes.  Each rank's list is in assignment order,
    group by group.

    ``param_groups`` lists indices into ``params`` per optimizer param group
    (default: one group with all parameters, in order).
    """
    _check_pos_int("world_size", world_size)
    groups = [list(range(len(params)))] if param_groups is None else [list(g) for g in param_groups]
    flat = [i for g in groups for i in g]
    if sorted(flat) != sorted(set(flat)) or any(not 0 <= i < len(params) for i in flat):
        raise ConfigError("param_groups must hold distinct indices into params")
    sizes = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for group in groups:
        for i in sorted(group, key=lambda j: params[j].numel, reverse=True):
            rank = min(range(world_size), key=lambda r: (sizes[r], r))
            out[rank].append(i)
            sizes[rank] += params[i].numel
    return out


def fsdp_shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """(rows, padded_rows) of a dim-0 FSDP2 shard.

    FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
    ``_init_sharded_param``) splits dim 0 with ``torch.chunk`` into chunks of
    ceil(dim0 / N) rows; trailing ranks get a shorter or empty chunk
    (``_chunk_with_empty``).  Every rank stores a zero-padded buffer of the
    first chunk's size ("0th always padded"), so ``padded_rows`` is the same
    on all ranks while ``rows`` sums to ``dim0``.
    """
    _check_pos_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
    if dim0 < 0:
        raise ConfigError(f"dim0 must be ≥ 0, got {dim0}")
    chunk = -(-dim0 // world_size)
    rows = max(0, min(chunk, dim0 - rank * chunk))
    return rows, chunk


@dataclass(frozen=True)
class FsdpShard:
    """One parameter's FSDP2 shard on one rank (element counts, not bytes)."""

    name: str
    rows: int
    padded_rows: int
    numel: int
    padded_numel: int


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds for model states under a PyTorch implementation.

    Attributes:
        rank, world_size, strategy, optimizer: what was modelled.
        params: parameter *storage* bytes (FSDP2: the padded shard buffer).
        params_unpadded: bytes of the parameter elements visible on the rank
            (FSDP2: the unpadded local shard; otherwise = ``params``).
        grads: bytes of the ``.grad`` elements (FSDP2: unpadded shard).
        grad_storage: bytes of the storage the gradients live in: FSDP2 views
            each group's gradients into one reduce-scatter output that includes
            the padding; otherwise = ``grads``.
        comm_buffers: DDP's flat bucket buffers, a second copy of the
            gradients unless ``gradient_as_bucket_view=True`` (then 0).
        optimizer_moments: ``exp_avg`` + ``exp_avg_sq`` (+ ``max_exp_avg_sq``)
            for Adam/AdamW, ``momentum_buffer`` for SGD with momentum.
        optimizer_steps: Adam's per-parameter ``step`` tensors, 4 bytes each
            (float32 scalars; on the CPU unless fused/capturable).
        owned: names of the parameters whose optimizer state lives here.
        shards: per-parameter FSDP2 shard geometry (empty for ddp/zero1).
    """

    rank: int
    world_size: int
    strategy: str
    optimizer: str
    params: int
    params_unpadded: int
    grads: int
    grad_storage: int
    comm_buffers: int
    optimizer_moments: int
    optimizer_steps: int
    owned: tuple[str, ...] = ()
    shards: tuple[FsdpShard, ...] = field(default=())

    @property
    def optimizer_state(self) -> int:
        """optimizer_moments + optimizer_steps (all of ``optimizer.state``)."""
        return self.optimizer_moments + self.optimizer_steps

    @property
    def tensor_bytes(self) -> int:
        """params + grad_storage + optimizer_state: what walking the parameters,
        their ``.grad`` and ``optimizer.state`` finds, each storage once (DDP's
        separate bucket buffers are not reachable that way)."""
        return self.params + self.grad_storage + self.optimizer_state

    @property
    def total(self) -> int:
        """All storage bytes: tensor_bytes + comm_buffers."""
        return self.tensor_bytes + self.comm_buffers


#: Bytes of one Adam ``step`` tensor: ``torch.tensor(0.0, dtype=_get_scalar_dtype())``
#: is a float32 scalar (float64 only if the default dtype was changed to float64).
ADAM_STEP_BYTES: int = 4


def _state_bytes(numel: int, itemsize: int, optimizer: OptimizerName, amsgrad: bool) -> tuple[int, int]:
    """(moment bytes, step bytes) of one parameter's optimizer state."""
    if optimizer in ("adam", "adamw"):
        copies = 3 if amsgrad else 2
        return copies * numel * itemsize, ADAM_STEP_BYTES
    if optimizer == "sgd-momentum":
        return numel * itemsize, 0
    return 0, 0


def exact_rank_bytes(
    params: Sequence[ParamSpec],
    world_size: int,
    strategy: Strategy,
    optimizer: OptimizerName = "adam",
    *,
    amsgrad: bool = False,
    gradient_as_bucket_view: bool = False,
    param_groups: Sequence[Sequence[int]] | None = None,
) -> list[RankBytes]:
    """Bytes each rank holds after ``optimizer.step()`` (before ``zero_grad``).

    Models the real objects, parameter by parameter:

    * ``"ddp"`` — ``DistributedDataParallel``: full params and full ``.grad``
      on every rank; the reducer's flat bucket buffers add a second copy of the
      trainable gradients unless ``gradient_as_bucket_view=True`` (then the
      grads are views into the buckets and are counted once).  Full optimizer
      state on every rank.
    * ``"zero1"`` — ``ZeroRedundancyOptimizer`` over a DDP model: like DDP,
      but optimizer state only for the parameters :func:`zero1_partition`
      assigns to the rank (whole parameters, greedy by size).
    * ``"zero3"`` — FSDP2 ``fully_shard``: each parameter stored as its padded
      dim-0 shard (:func:`fsdp_shard_rows`); gradients are unpadded shard views
      into the reduce-scatter output of their ``fully_shard`` group, which is
      padded like the parameters (``grad_storage``; grouping does not change
      the sum); optimizer state on the unpadded local shard (``zeros_like`` /
      ``clone`` of a DTensor).
    * ``"zero2"`` — FSDP2 with ``reshard_after_forward=False``: it keeps the
      unsharded parameters between forward and backward but reshards after
      backward, so *between steps* it holds exactly what ``"zero3"`` holds.

    Optimizer state is created lazily by the first step and only for
    parameters with a gradient (frozen parameters get none): Adam/AdamW hold
    ``exp_avg`` and ``exp_avg_sq`` (param dtype and shape; plus
    ``max_exp_avg_sq`` with ``amsgrad``) and a float32 ``step`` scalar per
    parameter (``torch/optim/adam.py``; on the CPU unless fused/capturable);
    SGD with momentum a ``momentum_buffer`` cloned from the gradient; plain SGD
    nothing.  Not counted: activations, the all-gathered parameters during
    FSDP forward/backward, allocator rounding and fragmentation, and
    AMP/mixed-precision policies (parameters and gradients use each
    ParamSpec's dtype).
    """
    _check_pos_int("world_size", world_size)
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("optimizer", optimizer, MODELED_OPTIMIZERS)
    out: list[RankBytes] = []
    if strategy == "zero1" and len({p.dtype for p in params}) > 1:
        found = ", ".join(sorted({p.dtype for p in params}))
        raise ConfigError(
            f"ZeroRedundancyOptimizer needs one dense dtype for all parameters, got {found} "
            "(it raises ValueError in _verify_same_dense_param_type); cast the model to one dtype "
            "or use FSDP2 (strategy 'zero2'/'zero3')"
        )
    if is_ddp(strategy):
        full = sum(p.nbytes for p in params)
        grads = sum(p.nbytes for p in params if p.requires_grad)
        buckets = 0 if gradient_as_bucket_view else grads
        owners = (
            zero1_partition(params, world_size, param_groups)
            if strategy == "zero1"
            else [list(range(len(params)))] * world_size
        )
        for rank in range(world_size):
            mom = steps = 0
            owned = []
            for i in owners[rank]:
                p = params[i]
                if not p.requires_grad:
                    continue
                m, s = _state_bytes(p.numel, p.itemsize, optimizer, amsgrad)
                mom += m
                steps += s
                owned.append(p.name)
            out.append(
                RankBytes(rank, world_size, strategy, optimizer, full, full, grads, grads, buckets, mom, steps,
                          tuple(owned), ())
            )
        return out

    for p in params:
        if len(p.shape) == 0:
            raise ConfigError(
                f"FSDP2 shards every parameter on dim 0, but {p.name!r} is 0-dimensional "
                "(fully_shard raises for it); give it shape (1,) or keep it out of fully_shard"
            )
    for rank in range(world_size):
        stor = unp = grads = gstore = mom = steps = 0
        shards = []
        owned = []
        for p in params:
            rows, padded = fsdp_shard_rows(p.shape[0], world_size, rank)
            numel, pnumel = rows * p.row_numel, padded * p.row_numel
            shards.append(FsdpShard(p.name, rows, padded, numel, pnumel))
            stor += pnumel * p.itemsize
            unp += numel * p.itemsize
            if not p.requires_grad:
                continue
            grads += numel * p.itemsize
            gstore += pnumel * p.itemsize
            m, s = _state_bytes(numel, p.itemsize, optimizer, amsgrad)
            mom += m
            steps += s
            owned.append(p.name)
        out.append(
            RankBytes(rank, world_size, strategy, optimizer, stor, unp, grads, gstore, 0, mom, steps,
                      tuple(owned), tuple(shards))
        )
    return out
