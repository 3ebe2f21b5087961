"""Frozen records that notebooks may still index as the dicts they once were.

Fields are read as attributes (``s.loss``); ``s["loss"]``, ``s.get("loss")``
and ``"loss" in s`` keep working for notebooks written against the dicts.
Pure: no torch, no IPython.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any


class Indexed:
    """``r["name"]`` / ``r.get("name")`` / ``"name" in r`` over a frozen dataclass's fields."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._names() else default

    def __contains__(self, key: object) -> bool:
        return key in self._names()

    def keys(self) -> list[str]:
        return list(self._names())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
