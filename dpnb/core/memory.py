"""Per-rank memory of model states under ZeRO stages 0–3, analytic and exact.

The distributed story
---------------------
Plain data parallelism (DDP, "ZeRO stage 0") keeps a full copy of the
parameters, the gradients and the optimizer state on every rank, so adding
ranks adds throughput but never room.  ZeRO (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054, §5) removes that redundancy in three steps, each sharding one
more part across the N data-parallel ranks:

* stage 1 (P_os) shards the optimizer states.  Gradients are still
  all-reduced in full; each rank updates only the parameters it owns and then
  broadcasts / all-gathers them.
* stage 2 (P_os+g) also shards gradients: a reduce-scatter leaves each rank
  only the averaged gradient slice it needs for its own update.
* stage 3 (P_os+g+p) also shards parameters: a layer's parameters are
  all-gathered just before its forward and again before its backward, and
  freed right after.

Counting bytes per parameter (Ψ parameters, N ranks), the paper's mixed
precision Adam example (§3.1) holds fp16 parameters (2Ψ) and fp16 gradients
(2Ψ) plus K = 12 bytes of optimizer state: an fp32 master copy of the weights
(4Ψ), and Adam's momentum and variance in fp32 (4Ψ + 4Ψ).  Hence 16Ψ without
sharding and, per rank::

    ZeRO-1: 2Ψ + 2Ψ + 12Ψ/N
    ZeRO-2: 2Ψ + 14Ψ/N
    ZeRO-3: 16Ψ/N

Sources count the optimizer state differently (with or without the master
weights; e.g. "Adam's moments are 8 bytes/param" vs the paper's K = 12), so
:class:`MemoryBreakdown` reports ``master_weights`` and ``optimizer_moments``
as separate parts and ``optimizer_states`` as their sum.

What is *not* counted anywhere in this module: activations (they depend on
micro-batch, sequence length and checkpointing), temporary buffers (the
all-gathered layer under ZeRO-3, communication buckets in the analytic model,
fp32 gradient copies made transiently during the step), the CUDA context and
allocator fragmentation.  Real peak memory is therefore higher; leave head-room
(``reserved_bytes`` in :func:`max_params_that_fit`).

Units: bytes.  Helpers in :mod:`dpnb.core.units` convert to decimal GB (1e9,
used by the published figures reproduced in the tests) or GiB (2**30).

The exact mode (:func:`exact_rank_bytes`) counts what the PyTorch objects hold
for a concrete parameter list: DDP, ``ZeroRedundancyOptimizer`` (ZeRO-1) and
FSDP2 ``fully_shard`` (ZeRO-2/3), byte for byte.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

from dpnb.core.errors import ConfigError
from dpnb.core.units import GB, dtype_bytes

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
OptimizerName = Literal["adam", "adamw", "sgd-momentum", "sgd"]
Offload = Literal["none", "optimizer", "optimizer+params"]
Strategy = Literal["ddp", "zero1", "zero2", "zero3"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed")
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd-momentum", "sgd")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
STAGES: tuple[int, ...] = (0, 1, 2, 3)
STRATEGIES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")

# The five model-state parts, in report order.
_PARTS: tuple[str, ...] = ("params", "grads", "grad_accum", "master_weights", "optimizer_moments")
# The first stage at which each part is sharded (ZeRO paper §5.1–5.3).
_SHARDED_FROM_STAGE: dict[str, int] = {
    "master_weights": 1,
    "optimizer_moments": 1,
    "grads": 2,
    "grad_accum": 2,
    "params": 3,
}


def _check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check_pos_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def bytes_per_param_parts(
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adam",
    fp32_grad_accum: bool = False,
) -> dict[str, int]:
    """Unsharded bytes per parameter of each model-state part.

    * ``params``: 4 in fp32, 2 in bf16/fp16 mixed precision (the working copy
      used by forward and backward).
    * ``grads``: same dtype as the working params (4 or 2).
    * ``grad_accum``: 4 when ``fp32_grad_accum`` and mixed precision: an fp32
      buffer gradients are accumulated into, kept *in addition to* the
      half-precision gradients (Megatron-LM's fp32 ``main_grad``, DeepSpeed's
      fp32 gradient accumulation).  Ignored (0) in fp32, where grads already
      are fp32.
    * ``master_weights``: 4 in mixed precision (fp32 copy the optimizer
      updates), 0 in fp32 (the params are the master copy).
    * ``optimizer_moments``: fp32 state of the update rule: Adam/AdamW
      momentum + variance = 8; SGD with momentum = 4; plain SGD = 0.

    Mixed precision + Adam gives 2 + 2 + 4 + 8 = 16 (ZeRO paper §3.1, K = 12 =
    master + moments); with ``fp32_grad_accum`` 20 (Megatron-LM's
    ``docs/source/distrib_optimizer.md`` table, "fp16 param, fp16 grads" row).
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    mixed = precision != "fp32"
    working = 2 if mixed else 4
    moments = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]
    return {
        "params": working,
        "grads": working,
        "grad_accum": 4 if (mixed and fp32_grad_accum) else 0,
        "master_weights": 4 if mixed else 0,
        "optimizer_moments": moments,
    }


def _host_parts(offload: Offload) -> frozenset[str]:
    if offload == "optimizer":
        return frozenset({"master_weights", "optimizer_moments"})
    if offload == "optimizer+params":
        return frozenset({"master_weights", "optimizer_moments", "params"})
    return frozenset()


def _per_rank_fractions(
    dp: int,
    stage: int,
    precision: Precision,
    optimizer: OptimizerName,
    fp32_grad_accum: bool,
) -> dict[str, Fraction]:
    """Per-rank bytes per model parameter of each part, as exact fractions."""
    coef = bytes_per_param_parts(precision, optimizer, fp32_grad_accum)
    return {
        part: Fraction(coef[part], dp if stage >= _SHARDED_FROM_STAGE[part] else 1)
        for part in _PARTS
    }


def _validate(dp: int, stage: int, offload: Offload) -> None:
    _check_pos_int("dp", dp)
    _check_choice("stage", stage, STAGES)
    _check_choice("offload", offload, OFFLOADS)
    if offload == "optimizer+params" and stage != 3:
        raise ConfigError(
            f"offload='optimizer+params' needs stage 3, got stage {stage}: in stages "
            "0–2 every rank runs forward/backward on its full parameter copy, so it "
            "must stay on the device (DeepSpeed ZeRO-Infinity and FSDP CPU offload "
            "only offload sharded parameters); use stage=3 or offload='optimizer'"
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank bytes of each model-state part (device side and host side).

    Device parts: ``params``, ``grads``, ``grad_accum`` (fp32 accumulation
    buffer, 0 unless requested), ``master_weights``, ``optimizer_moments``.
    With CPU offload the offloaded parts are 0 on the device and appear in the
    matching ``host_*`` field instead.  Bytes are floats because Ψ/N need not
    be whole; activations, temporaries and fragmentation are not counted.
    """

    n_params: float
    dp: int
    stage: int
    precision: str
    optimizer: str
    fp32_grad_accum: bool
    offload: str
    params: float
    grads: float
    grad_accum: float
    master_weights: float
    optimizer_moments: float
    host_params: float = 0.0
    host_master_weights: float = 0.0
    host_optimizer_moments: float = 0.0

    @property
    def optimizer_states(self) -> float:
        """Device bytes of master weights + optimizer moments (the paper's K·Ψ)."""
        return self.master_weights + self.optimizer_moments

    @property
    def total(self) -> float:
        """Device bytes of all model states on one rank."""
        return self.params + self.grads + self.grad_accum + self.master_weights + self.optimizer_moments

    @property
    def host_total(self) -> float:
        """Host (CPU) bytes per rank moved there by offload."""
        return self.host_params + self.host_master_weights + self.host_optimizer_moments

    @property
    def bytes_per_param(self) -> float:
        """Device bytes on one rank per model parameter (16 for unsharded mixed-precision Adam)."""
        return self.total / self.n_params if self.n_params else 0.0

    def parts(self) -> dict[str, float]:
        """Device part name → bytes, in report order."""
        return {p: float(getattr(self, p)) for p in _PARTS}

    def fits(self, capacity_bytes: float, reserved_bytes: float = 0.0) -> bool:
        """Whether ``total`` fits in ``capacity_bytes`` minus ``reserved_bytes``."""
        return self.total <= capacity_bytes - reserved_bytes

    def describe(self) -> str:
        """A one-line summary in decimal GB (1e9 bytes)."""
        shown = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in self.parts().items() if v)
        host = f"; host {self.host_total / GB:.3g} GB" if self.host_total else ""
        return (
            f"ZeRO-{self.stage} DP={self.dp} {self.precision} {self.optimizer}: "
            f"{shown} = {self.total / GB:.4g} GB per rank{host}"
        )


def zero_memory(
    n_params: float,
    dp: int,
    stage: int,
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adam",
    *,
    fp32_grad_accum: bool = False,
    offload: Offload = "none",
) -> MemoryBreakdown:
    """Per-rank model-state bytes under ZeRO ``stage`` with ``dp`` ranks.

    Part sizes per parameter come from :func:`bytes_per_param_parts`; a part is
    divided by ``dp`` from the stage that shards it (optimizer states and master
    weights from stage 1, gradients from 2, parameters at 3; Rajbhandari et al.
    2020, arXiv:1910.02054, §5 and Figure 1).  Offload moves parts to the host
    (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840; ZeRO-Infinity,
    Rajbhandari et al. 2021, arXiv:2104.07857): ``"optimizer"`` moves master
    weights and moments, ``"optimizer+params"`` (stage 3 only) also the
    parameter shards.  Gradients are kept on the device here; real offload
    engines stream reduced gradient shards to the host during backward, which
    only lowers the device figure further.  Activations, temporary buffers and
    fragmentation are not counted.
    """
    if not (isinstance(n_params, (int, float)) and n_params >= 0 and math.isfinite(n_params)):
        raise ConfigError(f"n_params must be a non-negative finite number, got {n_params!r}")
    _validate(dp, stage, offload)
    fr = _per_rank_fractions(dp, stage, precision, optimizer, fp32_grad_accum)
    n = Fraction(n_params)
    raw = {p: float(n * fr[p]) for p in _PARTS}
    host = _host_parts(offload)
    dev = {p: (0.0 if p in host else raw[p]) for p in _PARTS}
    return MemoryBreakdown(
        n_params=n_params,
        dp=dp,
        stage=stage,
        precision=precision,
        optimizer=optimizer,
        fp32_grad_accum=fp32_grad_accum,
        offload=offload,
        host_params=raw["params"] if "params" in host else 0.0,
        host_master_weights=raw["master_weights"] if "master_weights" in host else 0.0,
        host_optimizer_moments=raw["optimizer_moments"] if "optimizer_moments" in host else 0.0,
        **dev,
    )


def memory_table(
    n_params: float,
    dp: int,
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adam",
    *,
    fp32_grad_accum: bool = False,
    offload: Offload = "none",
) -> list[MemoryBreakdown]:
    """:func:`zero_memory` for stages 0, 1, 2, 3 (one row each).

    ``offload="optimizer+params"`` only applies to stage 3; the rows for
    stages 0–2 then use ``offload="optimizer"``.
    """
    rows = []
    for stage in STAGES:
        off: Offload = "optimizer" if (offload == "optimizer+params" and stage != 3) else offload
        rows.append(
            zero_memory(n_params, dp, stage, precision, optimizer, fp32_grad_accum=fp32_grad_accum, offload=off)
        )
    return rows


def _device_fraction(
    dp: int, stage: int, precision: Precision, optimizer: OptimizerName, fp32_grad_accum: bool, offload: Offload
) -> tuple[Fraction, Fraction]:
    """(unsharded, sharded) device bytes per parameter per rank, before dividing by dp."""
    coef = bytes_per_param_parts(precision, optimizer, fp32_grad_accum)
    host = _host_parts(offload)
    fixed = Fraction(0)
    sharded = Fraction(0)
    for p in _PARTS:
        if p in host:
            continue
        if stage >= _SHARDED_FROM_STAGE[p]:
            sharded += coef[p]
        else:
            fixed += coef[p]
    return fixed, sharded


def max_params_that_fit(
    capacity_bytes: float,
    dp: int,
    stage: int,
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adam",
    *,
    fp32_grad_accum: bool = False,
    offload: Offload = "none",
    reserved_bytes: float = 0.0,
) -> int:
    """Largest parameter count whose model states fit one device.

    Solves Ψ · (fixed + sharded/N) ≤ capacity − reserved for Ψ, where "fixed"
    are the bytes/param replicated at this stage and "sharded" those divided
    by N = ``dp`` (see :func:`zero_memory`).  E.g. an 80 GB device with
    unsharded mixed-precision Adam (16 B/param) holds at most 5e9 parameters.
    ``reserved_bytes`` is head-room for what the model does not count
    (activations, temporaries, CUDA context, fragmentation).
    """
    _validate(dp, stage, offload)
    fixed, sharded = _device_fraction(dp, stage, precision, optimizer, fp32_grad_accum, offload)
    per_param = fixed + sharded / dp
    room = Fraction(capacity_bytes) - Fraction(reserved_bytes)
    if room <= 0:
        return 0
    if per_param == 0:
        raise ConfigError(
            f"nothing is held on the device for stage {stage}, {precision}, {optimizer}, "
            f"offload={offload!r}: 0 bytes/param, so any model 'fits'; count activations instead"
        )
    return math.floor(room / per_param)


def min_dp_to_fit(
    n_params: float,
    capacity_bytes: float,
    stage: int,
    precision: Precision = "bf16-mixed",
    optimizer: OptimizerName = "adam",
    *,
    fp32_grad_accum: bool = False,
    offload: Offload = "none",
    reserved_bytes: float = 0.0,
) -> int:
    """Smallest DP degree at which the model states fit one device, under ``stage``.

    Needs Ψ·fixed + Ψ·sharded/N ≤ capacity − reserved, i.e.
    N ≥ Ψ·sharded / (capacity − reserved − Ψ·fixed).  Raises
    :class:`ConfigError`, showing every term, when no N is enough (the
    replicated part alone exceeds the device).
    """
    _validate(1, stage, offload)
    fixed, sharded = _device_fraction(1, stage, precision, optimizer, fp32_grad_accum, offload)
    n = Fraction(n_params)
    room = Fraction(capacity_bytes) - Fraction(reserved_bytes) - n * fixed
    if room >= n * sharded:
        return 1
    if room <= 0 or sharded == 0:
        raise ConfigError(
            f"{n_params:.4g} params never fit {capacity_bytes / GB:.4g} GB under ZeRO-{stage} "
            f"({precision}, {optimizer}, offload={offload!r}): the replicated part alone is "
            f"{float(fixed)} B/param × {n_params:.4g} = {float(n * fixed) / GB:.4g} GB"
            + (f" plus {reserved_bytes / GB:.4g} GB reserved" if reserved_bytes else "")
            + "; use a higher ZeRO stage, offload, tensor/pipeline parallelism, or a bigger device"
        )
    return math.ceil(n * sharded / room)


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
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    out: list[RankBytes] = []
    if strategy == "zero1" and len({p.dtype for p in params}) > 1:
        found = ", ".join(sorted({p.dtype for p in params}))
        raise ConfigError(
            f"ZeroRedundancyOptimizer needs one dense dtype for all parameters, got {found} "
            "(it raises ValueError in _verify_same_dense_param_type); cast the model to one dtype "
            "or use FSDP2 (strategy 'zero2'/'zero3')"
        )
    if strategy in ("ddp", "zero1"):
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
