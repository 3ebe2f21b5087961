"""Byte units and dtype sizes.

Published memory and bandwidth figures for distributed training (the ZeRO
paper, vendor datasheets, nccl-tests output) use decimal units: 1 GB = 1e9
bytes and 1 GB/s = 1e9 bytes/s.  dpnb follows them so the quoted numbers can be
reproduced exactly, and offers binary (GiB = 2**30 bytes) helpers for the
values PyTorch reports (``torch.cuda.memory_allocated`` and friends count
bytes; people usually print them in GiB).  Every function here says which
unit it uses.

Bucket caps in PyTorch DDP are binary: ``bucket_cap_mb=25`` means
25 × 2**20 bytes (``torch/nn/parallel/distributed.py``, ``_MB_TO_BYTES``).
"""

from typing import Final

from dpnb.core.errors import ConfigError

KB: Final[int] = 10**3
MB: Final[int] = 10**6
GB: Final[int] = 10**9
TB: Final[int] = 10**12
KiB: Final[int] = 2**10
MiB: Final[int] = 2**20
GiB: Final[int] = 2**30

#: Bytes per element for the dtype names dpnb accepts (the spelling of
#: ``str(torch.float32)`` without the ``torch.`` prefix, plus common aliases).
DTYPE_BYTES: Final[dict[str, int]] = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` (e.g. ``"bfloat16"`` → 2).

    Accepts ``"torch.float32"`` as well as ``"float32"`` so that ``str(p.dtype)``
    can be passed straight through.
    """
    key = dtype.removeprefix("torch.")
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ConfigError(
            f"unknown dtype {dtype!r}; use one of: {known} "
            "(the name str(tensor.dtype) prints, with or without 'torch.')"
        ) from None


def to_gb(n_bytes: float) -> float:
    """Bytes → decimal gigabytes (1 GB = 1e9 bytes), the unit of published figures."""
    return n_bytes / GB


def to_gib(n_bytes: float) -> float:
    """Bytes → binary gibibytes (1 GiB = 2**30 bytes), the unit tools usually print."""
    return n_bytes / GiB


def from_gb(gb: float) -> float:
    """Decimal gigabytes → bytes (1 GB = 1e9 bytes)."""
    return gb * GB


def from_gib(gib: float) -> float:
    """Binary gibibytes → bytes (1 GiB = 2**30 bytes)."""
    return gib * GiB
