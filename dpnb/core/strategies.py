"""The data-parallel strategies dpnb knows, by name and family: the one place they are spelled.

``ddp``
    ``DistributedDataParallel``: every rank holds everything; gradients are
    all-reduced bucket by bucket during backward.  ZeRO stage 0.
``zero1``
    DDP plus ``ZeroRedundancyOptimizer``: optimizer state is partitioned over
    the ranks (stage 1); each rank steps its partition and broadcasts it.
``zero2`` / ``zero3``
    FSDP2 ``fully_shard`` without / with resharding after forward: gradients
    are reduce-scattered, parameters all-gathered per unit (stages 2 and 3).

Two *families* decide how a strategy communicates and is wrapped: the DDP
family (``ddp``, ``zero1``) has gradient buckets and a ``DistributedDataParallel``
wrapper; the FSDP family (``zero2``, ``zero3``) shards parameters per unit.
"""

from __future__ import annotations

from typing import Final

from dpnb.core.errors import ConfigError

STRATEGIES: Final[tuple[str, ...]] = ("ddp", "zero1", "zero2", "zero3")
DDP_FAMILY: Final[tuple[str, ...]] = ("ddp", "zero1")
FSDP_FAMILY: Final[tuple[str, ...]] = ("zero2", "zero3")
#: ZeRO stage of each strategy (the ZeRO paper's P_os = 1, P_os+g = 2, P_os+g+p = 3).
ZERO_STAGE: Final[dict[str, int]] = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}

#: Options of ``%dp wrap`` / ``%dp train`` that several layers validate.
MIXED_PRECISION: Final[tuple[str, ...]] = ("none", "bf16", "fp16")
OPTIMIZERS: Final[tuple[str, ...]] = ("adamw", "adam", "sgd")
LR_SCALES: Final[tuple[str, ...]] = ("none", "linear", "sqrt")


def is_fsdp(strategy: str | None) -> bool:
    """Whether ``strategy`` shards parameters with FSDP2 (zero2 / zero3)."""
    return strategy in FSDP_FAMILY


def is_ddp(strategy: str | None) -> bool:
    """Whether ``strategy`` uses the DDP wrapper and its gradient buckets (ddp / zero1)."""
    return strategy in DDP_FAMILY


def check_strategy(strategy: str) -> str:
    """``strategy`` itself if dpnb knows it, else a :class:`ConfigError` naming the choices."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    return strategy


#: DDP communication hooks ``%dp wrap --comm-hook`` offers (gradient compression)
COMM_HOOKS: Final[tuple[str, ...]] = ("none", "fp16", "bf16", "powersgd")


def parse_comm_hook(spec: str | None) -> tuple[str, int | None]:
    """``"fp16"`` -> ``("fp16", None)``; ``"powersgd:2"`` -> ``("powersgd", 2)``
    (PowerSGD's matrix rank, default 1); ``None`` / ``"none"`` -> ``("none", None)``."""
    text = (spec or "none").strip().lower()
    kind, _, arg = text.partition(":")
    if kind not in COMM_HOOKS:
        raise ConfigError(f"unknown --comm-hook {spec!r}: choose one of "
                          f"{', '.join(COMM_HOOKS)} (powersgd:R for rank R)")
    if kind != "powersgd":
        if arg:
            raise ConfigError(f"--comm-hook {kind} takes no ':{arg}'; only powersgd:R has a rank")
        return kind, None
    if not arg:
        return kind, 1
    if not arg.isdigit() or int(arg) < 1:
        raise ConfigError(f"--comm-hook powersgd:{arg}: the rank must be a whole number >= 1 "
                          f"(e.g. powersgd:2)")
    return kind, int(arg)


def comm_hook_label(spec: str | None) -> str:
    """``"powersgd"`` -> ``"powersgd:1"``: the comm hook as records and messages name it."""
    kind, rank = parse_comm_hook(spec)
    return f"{kind}:{rank}" if rank is not None else kind
