"""Parsing ``--ranks`` selections and printing rank sets compactly."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import RankSpecError

_SPEC_HELP = ("use a rank ('0'), a list ('0,2'), a range ('1:' , ':2', '1:3', '0-2') "
              "or 'all'")


def parse_ranks(spec: str | int | Iterable[int] | None, world_size: int) -> list[int]:
    """Ranks selected by ``spec`` among ``0..world_size-1``, sorted, unique.

    Slices follow Python (``1:`` is rank 1 to the last, ``:2`` is ranks 0 and
    1); ``a-b`` is inclusive, as people write rank ranges in logs.
    """
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        items = _parse_str(spec.strip(), world_size)
    else:
        try:
            items = [int(r) for r in spec]
        except (TypeError, ValueError):
            raise RankSpecError(f"bad rank selection {spec!r}: {_SPEC_HELP}") from None
    bad = [r for r in items if not 0 <= r < world_size]
    if bad:
        raise RankSpecError(
            f"rank{'s' if len(bad) > 1 else ''} {format_ranks(bad)} out of range: the cluster has "
            f"{world_size} ranks (0-{world_size - 1}); {_SPEC_HELP}")
    if not items:
        raise RankSpecError(f"rank selection {spec!r} selects no rank; {_SPEC_HELP}")
    return sorted(set(items))


def _parse_str(spec: str, world_size: int) -> list[int]:
    if spec in ("", "all", "*", ":"):
        return list(range(world_size))
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                pieces = part.split(":")
                if len(pieces) > 3:
                    raise ValueError
                nums = [int(p) if p.strip() else None for p in pieces]
                out.extend(range(world_size)[slice(*nums)])
            elif "-" in part[1:]:
                a, b = part.split("-", 1) if not part.startswith("-") else (part, "")
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise RankSpecError(f"bad rank selection {spec!r}: {_SPEC_HELP}") from None
    return out


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def rank_label(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {format_ranks(rs)}"
