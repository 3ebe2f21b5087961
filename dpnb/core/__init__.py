"""dpnb.core: the pure numerical model of data-parallel training.

Batch arithmetic (:mod:`~dpnb.core.batch`), ZeRO memory, analytic and exact
(:mod:`~dpnb.core.memory`), collective communication cost
(:mod:`~dpnb.core.comm`), DDP bucketing and overlap
(:mod:`~dpnb.core.bucketing`), scaling and stragglers
(:mod:`~dpnb.core.scaling`).  Pure Python: importing it never imports torch,
numpy or IPython, so notebooks, tests and docs can use it anywhere.
Every formula's source is cited in its docstring.
"""

from dpnb.core.batch import (
    BatchConfig,
    BatchSolution,
    Parallelism,
    factor_world,
    scale_lr,
    solve_dp,
    solve_grad_accum,
)
from dpnb.core.bucketing import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    Bucket,
    Interval,
    Timeline,
    assign_buckets,
    ddp_bucket_caps,
    ddp_buckets,
    initial_ddp_buckets,
    overlap_timeline,
    proportional_backward,
    rebuild_buckets,
)
from dpnb.core.comm import (
    LINKS,
    CommPhase,
    Link,
    StepVolume,
    algbw,
    bus_factor,
    busbw,
    collective_bytes,
    collective_steps,
    collective_time,
    step_volume,
)
from dpnb.core.errors import ConfigError
from dpnb.core.exact_memory import (
    FsdpShard,
    ParamSpec,
    RankBytes,
    exact_rank_bytes,
    fsdp_shard_rows,
    param_specs,
    zero1_partition,
)
from dpnb.core.memory import (
    MemoryBreakdown,
    bytes_per_param_parts,
    max_params_that_fit,
    memory_table,
    min_dp_to_fit,
    zero_memory,
)
from dpnb.core.scaling import (
    HierarchicalAllReduce,
    ScalingPoint,
    StragglerEstimate,
    allreduce_comm,
    expected_step_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    scaling,
    step_time,
    straggler_estimate,
    straggler_probability,
)
from dpnb.core.units import GB, GiB, MiB, TB, dtype_bytes, from_gb, from_gib, to_gb, to_gib

__all__ = [
    "BatchConfig", "BatchSolution", "Parallelism", "factor_world", "scale_lr", "solve_dp", "solve_grad_accum",
    "DEFAULT_BUCKET_CAP_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "Bucket", "Interval", "Timeline",
    "assign_buckets", "ddp_bucket_caps", "ddp_buckets", "initial_ddp_buckets", "overlap_timeline",
    "proportional_backward", "rebuild_buckets",
    "LINKS", "CommPhase", "Link", "StepVolume", "algbw", "bus_factor", "busbw", "collective_bytes",
    "collective_steps", "collective_time", "step_volume",
    "ConfigError",
    "FsdpShard", "MemoryBreakdown", "ParamSpec", "RankBytes", "bytes_per_param_parts", "exact_rank_bytes",
    "fsdp_shard_rows", "max_params_that_fit", "memory_table", "min_dp_to_fit", "param_specs",
    "zero1_partition", "zero_memory",
    "HierarchicalAllReduce", "ScalingPoint", "StragglerEstimate", "allreduce_comm", "expected_step_time",
    "hierarchical_allreduce_time", "ring_allreduce_time", "scaling", "step_time", "straggler_estimate",
    "straggler_probability",
    "GB", "GiB", "MiB", "TB", "dtype_bytes", "from_gb", "from_gib", "to_gb", "to_gib",
]
