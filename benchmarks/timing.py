"""Small timing helpers shared by the benchmark scripts (run as ``python benchmarks/X.py``)."""

from __future__ import annotations

import statistics
import time


def median_call(fn, k: int, warmup: int = 0) -> float:
    """Median wall time (seconds) of ``k`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
