"""DDP gradient bucketing and the backward/all-reduce overlap timeline.

The distributed story
---------------------
One all-reduce per parameter would pay the collective's fixed latency
hundreds of times; one all-reduce of everything after backward would leave
the network idle during backward and the GPU idle during the all-reduce.
PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 13(12), arXiv:2006.15704, §3.2)
groups gradients into *buckets* of about ``bucket_cap_mb`` (25 MiB) and
launches a bucket's asynchronous all-reduce as soon as autograd hooks have
marked all its gradients ready, so communication of late layers overlaps with
the backward of earlier ones.

How buckets are formed (``compute_bucket_assignment_by_size`` in
``torch/csrc/distributed/c10d/reducer.cpp``, exposed as
``torch.distributed._compute_bucket_assignment_by_size``): walk the
parameters in a given order, one running bucket per (dtype, device); add each
parameter's gradient bytes and close the bucket as soon as its size reaches
the current limit (so a bucket may exceed the limit by its last parameter).
The limits are a list, advanced after each closed bucket and then held at the
last value: ``[first_bucket_bytes_cap, bucket_bytes_cap]``.  Leftover buckets
are appended at the end.

When (PyTorch 2.13, ``torch/nn/parallel/distributed.py``):

* at construction, with the default ``find_unused_parameters=False`` (or
  ``static_graph=True``) DDP puts *all* parameters in a single bucket, because
  registration order need not match the order gradients become ready;
* after the first iteration the reducer *rebuilds* the buckets from the order
  in which gradients actually became ready (roughly reverse registration order
  for a feed-forward model), with limits [1 MiB, 25 MiB] — the small first
  bucket lets the first all-reduce start early;
* passing ``bucket_cap_mb`` explicitly sets the first-bucket cap to the same
  value (no 1 MiB bucket); see :func:`ddp_bucket_caps`.

Bytes here are gradient bytes (numel × element size).  The timeline model
assumes one communication stream (bucket all-reduces run one after another,
in bucket order) and ignores the kernel-launch and copy-in/copy-out costs.
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from dpnb.core.comm import Collective, Link, collective_time
from dpnb.core.errors import ConfigError
from dpnb.core.units import MiB

#: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (``kDefaultFirstBucketBytes``).
DEFAULT_FIRST_BUCKET_BYTES: int = 1 * MiB
#: DDP's default ``bucket_cap_mb`` = 25, in bytes (MiB, as DDP multiplies by 1024 × 1024).
DEFAULT_BUCKET_CAP_BYTES: int = 25 * MiB
# The "one bucket for everything" limit DDP uses before the first rebuild.
_NO_LIMIT: int = sys.maxsize


@dataclass(frozen=True)
class Bucket:
    """One DDP bucket: position in all-reduce order, parameter indices, gradient bytes, its cap."""

    index: int
    param_indices: tuple[int, ...]
    nbytes: int
    cap: int
    key: str = ""


def ddp_bucket_caps(bucket_cap_mb: float | None = None) -> tuple[int, int]:
    """(first_bucket_bytes_cap, bucket_bytes_cap) DDP uses for a ``bucket_cap_mb`` argument.

    Mirrors ``_BucketCapacityConfig.create`` in ``torch/nn/parallel/distributed.py``
    (PyTorch 2.13): the default (``None``) is 25 MiB with a 1 MiB first
    bucket; an explicit value applies to the first bucket too.
    """
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES
    if not bucket_cap_mb > 0:
        raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    cap = int(bucket_cap_mb * MiB)
    return cap, cap


def _check_sizes(param_bytes: Sequence[int]) -> None:
    for i, b in enumerate(param_bytes):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ConfigError(f"param_bytes[{i}] must be a non-negative int, got {b!r}")


def _check_caps(first: int, cap: int) -> None:
    if not (isinstance(cap, int) and cap > 0 and isinstance(first, int) and first > 0):
        raise ConfigError(
            f"bucket caps must be positive ints (bytes), got first_bucket_cap_bytes={first!r}, "
            f"bucket_cap_bytes={cap!r}"
        )


def assign_buckets(
    param_bytes: Sequence[int],
    order: Sequence[int],
    limits: Sequence[int],
    keys: Sequence[str] | None = None,
    sort_by_min_index: bool = False,
) -> list[Bucket]:
    """The bucket assignment algorithm of ``reducer.cpp``, in pure Python.

    Walks ``order`` (indices into ``param_bytes``); one running bucket per
    ``keys[i]`` (dtype/device; default one key); a bucket closes once its bytes
    reach the current limit, after which that key moves to the next limit in
    ``limits`` (staying on the last).  Leftover buckets follow in order of
    their key's first appearance (C++ iterates an unordered map there; with a
    single key the order is the same).  ``sort_by_min_index`` sorts buckets by
    their smallest parameter index, as the C++ code does when it is not given
    explicit tensor indices.
    """
    _check_sizes(param_bytes)
    if not limits or any(lim <= 0 for lim in limits):
        raise ConfigError(f"limits must be a non-empty list of positive byte counts, got {list(limits)!r}")
    if keys is not None and len(keys) != len(param_bytes):
        raise ConfigError(f"keys has {len(keys)} entries but param_bytes has {len(param_bytes)}")
    running: dict[str, tuple[list[int], int, int]] = {}
    limit_pos: dict[str, int] = {}
    closed: list[tuple[tuple[int, ...], int, int, str]] = []
    for i in order:
        key = "" if keys is None else keys[i]
        idx, size, _ = running.get(key, ([], 0, 0))
        pos = limit_pos.setdefault(key, 0)
        idx.append(i)
        size += param_bytes[i]
        limit = limits[pos]
        if size >= limit:
            closed.append((tuple(idx), size, limit, key))
            running[key] = ([], 0, 0)
            limit_pos[key] = min(pos + 1, len(limits) - 1)
        else:
            running[key] = (idx, size, limit)
    for key, (idx, size, limit) in running.items():
        if idx:
            closed.append((tuple(idx), size, limit, key))
    if sort_by_min_index:
        closed.sort(key=lambda b: min(b[0]))
    return [Bucket(k, idx, size, lim, key) for k, (idx, size, lim, key) in enumerate(closed)]


def _check_permutation(order: Sequence[int], n: int) -> None:
    if sorted(order) != list(range(n)):
        raise ConfigError(
            f"order must be a permutation of the {n} parameter indices 0..{n - 1}; got {list(order)!r}"
        )


def rebuild_buckets(
    param_bytes: Sequence[int],
    ready_order: Sequence[int],
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    dtypes: Sequence[str] | None = None,
) -> list[Bucket]:
    """Buckets DDP builds after the first iteration, from the gradient ready order.

    ``Reducer::rebuild_buckets`` (``reducer.cpp``) calls the assignment with
    the parameters in the order their gradients became ready and limits
    [first_bucket_cap_bytes, bucket_cap_bytes]; given explicit indices it
    does not re-sort, so bucket 0 holds the first-ready gradients and is
    all-reduced first.
    """
    _check_caps(first_bucket_cap_bytes, bucket_cap_bytes)
    _check_permutation(ready_order, len(param_bytes))
    return assign_buckets(param_bytes, ready_order, [first_bucket_cap_bytes, bucket_cap_bytes], dtypes)


def ddp_buckets(
    param_bytes: Sequence[int],
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    order: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[Bucket]:
    """Steady-state DDP buckets for gradients of ``param_bytes`` (registration order).

    ``order`` is the gradient ready order; by default the reverse of
    registration order, which is how backward visits a feed-forward model
    (Li et al. 2020, §3.2.3).  Equivalent to :func:`rebuild_buckets`.
    Bucket 0 is all-reduced first.
    """
    ready = list(reversed(range(len(param_bytes)))) if order is None else list(order)
    return rebuild_buckets(param_bytes, ready, bucket_cap_bytes, first_bucket_cap_bytes, dtypes)


def initial_ddp_buckets(
    param_bytes: Sequence[int],
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    *,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    dtypes: Sequence[str] | None = None,
) -> list[Bucket]:
    """Buckets DDP builds at construction, before the first rebuild.

    ``DistributedDataParallel._ddp_init_helper`` (PyTorch 2.13): one bucket
    per dtype unless ``find_unused_parameters=True`` and not ``static_graph``;
    then registration order with limits [first, cap] (just [cap] if they are
    equal), buckets sorted by smallest index and the list reversed, so the
    last-registered parameters are all-reduced first.
    """
    _check_caps(first_bucket_cap_bytes, bucket_cap_bytes)
    n = len(param_bytes)
    if static_graph or not find_unused_parameters:
        limits = [_NO_LIMIT]
    elif first_bucket_cap_bytes < bucket_cap_bytes:
        limits = [first_bucket_cap_bytes, bucket_cap_bytes]
    else:
        limits = [bucket_cap_bytes]
    fwd = assign_buckets(param_bytes, range(n), limits, dtypes, sort_by_min_index=True)
    return [Bucket(k, b.param_indices, b.nbytes, b.cap, b.key) for k, b in enumerate(reversed(fwd))]


@dataclass(frozen=True)
class Interval:
    """A half-open time interval [start, end) in seconds."""

    start: float
    end: float

    @property
    def duration(self) -> float:
        """end − start."""
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Backward compute and per-bucket all-reduce intervals of one step.

    ``sequential_s``: backward then all communication (no overlap);
    ``overlapped_s``: when the last all-reduce finishes with overlap;
    ``exposed_comm_s``: overlapped_s − compute_s, the communication the
    backward could not hide.
    """

    compute: tuple[Interval, ...]
    comm: tuple[Interval, ...]
    compute_s: float
    comm_s: float
    sequential_s: float
    overlapped_s: float
    exposed_comm_s: float

    @property
    def hidden_comm_s(self) -> float:
        """Communication time hidden behind backward: comm_s − exposed_comm_s."""
        return self.comm_s - self.exposed_comm_s

    @property
    def overlap_fraction(self) -> float:
        """Fraction of communication hidden (0 when there is none)."""
        return self.hidden_comm_s / self.comm_s if self.comm_s > 0 else 0.0

    @property
    def speedup(self) -> float:
        """sequential_s / overlapped_s."""
        return self.sequential_s / self.overlapped_s if self.overlapped_s > 0 else 1.0


def proportional_backward(bucket_bytes: Sequence[int], backward_s: float) -> list[float]:
    """Split a total backward time over buckets in proportion to their bytes.

    A first approximation (backward FLOPs scale with parameter count for dense
    layers); pass measured per-bucket times to :func:`overlap_timeline` instead
    when you have them.
    """
    total = sum(bucket_bytes)
    if total <= 0:
        return [backward_s / len(bucket_bytes)] * len(bucket_bytes) if bucket_bytes else []
    return [backward_s * b / total for b in bucket_bytes]


def overlap_timeline(
    bucket_bytes: Sequence[int],
    backward_s_per_bucket: float | Sequence[float],
    link: Link,
    n: int,
    kind: Collective = "all_reduce",
) -> Timeline:
    """Step timeline with each bucket's all-reduce overlapping later backward.

    Bucket i's gradients are ready when its backward slice ends; its
    collective starts at max(that moment, end of bucket i−1's collective)
    (one communication stream, in bucket order, as DDP launches them) and
    lasts :func:`~dpnb.core.comm.collective_time` on ``link`` with ``n``
    ranks.  Li et al. 2020 §3.2.3–3.2.4 describe the mechanism.  Forward
    pass and optimizer step add the same time to both variants and are left
    out.
    """
    k = len(bucket_bytes)
    if isinstance(backward_s_per_bucket, (int, float)):
        back = [float(backward_s_per_bucket)] * k
    else:
        back = [float(b) for b in backward_s_per_bucket]
        if len(back) != k:
            raise ConfigError(
                f"backward_s_per_bucket has {len(back)} entries but there are {k} buckets; give one per bucket"
            )
    if any(b < 0 for b in back):
        raise ConfigError("backward times must be ≥ 0")
    compute: list[Interval] = []
    comm: list[Interval] = []
    t = 0.0
    comm_free = 0.0
    for nbytes, b in zip(bucket_bytes, back):
        compute.append(Interval(t, t + b))
        t += b
        start = max(t, comm_free)
        comm_free = start + collective_time(kind, nbytes, n, link)
        comm.append(Interval(start, comm_free))
    compute_s = t
    comm_s = sum(c.duration for c in comm)
    overlapped = max(compute_s, comm_free)
    return Timeline(
        compute=tuple(compute),
        comm=tuple(comm),
        compute_s=compute_s,
        comm_s=comm_s,
        sequential_s=compute_s + comm_s,
        overlapped_s=overlapped,
        exposed_comm_s=overlapped - compute_s,
    )
