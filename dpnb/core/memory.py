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
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from dpnb.core.errors import ConfigError
from dpnb.core.units import GB

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
OptimizerName = Literal["adam", "adamw", "sgd-momentum", "sgd"]
Offload = Literal["none", "optimizer", "optimizer+params"]
Strategy = Literal["ddp", "zero1", "zero2", "zero3"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed")
#: the optimizers the memory model prices (SGD with and without momentum differ in state);
#: not ``core.strategies.OPTIMIZERS``, the ones ``%dp wrap`` builds
MODELED_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd-momentum", "sgd")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
STAGES: tuple[int, ...] = (0, 1, 2, 3)

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
    _check_choice("optimizer", optimizer, MODELED_OPTIMIZERS)
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

# Exact mode (per-rank bytes of real PyTorch objects) is dpnb.core.exact_memory.
