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


# ------------------------------------------------------------- formatting
def byte_scale(max_bytes: float, binary: bool = False) -> tuple[float, str]:
    """(divisor, unit) so that ``max_bytes / divisor`` is a readable number.

    Decimal by default (kB = 1e3, MB = 1e6, GB = 1e9 bytes, the unit of the
    published figures); ``binary`` uses KiB/MiB/GiB (2**10, 2**20, 2**30).
    """
    units = ([(2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")] if binary
             else [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")])
    for div, name in units:
        if abs(max_bytes) >= div:
            return float(div), name
    return 1.0, "B"


def unit_note(unit: str) -> str:
    """``"MB = 10⁶ bytes"`` style note for axis labels."""
    notes = {"TB": "10¹² B", "GB": "10⁹ B", "MB": "10⁶ B", "kB": "10³ B",
             "GiB": "2³⁰ B", "MiB": "2²⁰ B", "KiB": "2¹⁰ B", "B": "bytes"}
    return f"{unit}" if unit == "B" else f"{unit} = {notes[unit]}"


def fmt_bytes(n: float | None, binary: bool = False, digits: int = 4) -> str:
    """``1.23 GB`` (decimal) or ``1.15 GiB`` (binary); exact ``B`` below 1 kB."""
    if n is None:
        return "-"
    div, unit = byte_scale(abs(n), binary)
    if unit == "B":
        return f"{n:,.0f} B"
    return f"{n / div:.{digits}g} {unit}"


def fmt_signed_bytes(n: float) -> str:
    """``+1,024 B`` / ``0 B``: differences are shown in exact bytes."""
    return f"{n:+,.0f} B" if n else "0 B"


def fmt_ms(s: float | None, digits: int = 3) -> str:
    """Seconds → ``12.3 ms``."""
    if s is None:
        return "-"
    return f"{s * 1e3:.{digits}g} ms"


def fmt_count(n: float) -> str:
    """Counts (not bytes): ``7e9`` → ``7 bn``, ``1.25e8`` → ``125 M``, ``12.3 k``."""
    for div, unit in ((1e12, "tn"), (1e9, "bn"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.3g}"
