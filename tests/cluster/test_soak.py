"""The 45-second soak that CI runs (the 10-minute one: benchmarks/soak.py)."""

import importlib.util
import os


def _soak():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "soak.py")
    spec = importlib.util.spec_from_file_location("dpnb_soak", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_soak_recovers_every_fault_and_leaks_nothing():
    out = _soak().run_soak(45, seed=1, log=lambda *_: None)
    assert out["cycles"] >= 3
    assert out["recovered"] == out["injected"] == out["cycles"]
    assert out["leaked_pids"] == []
    first, last = out["fds_first_last"]
    assert last <= first + 4, out  # no descriptor leak in the notebook process
    for pid, mb in out["engine_rss_growth_mb"].items():
        assert mb < 150, out  # generous for a 1-minute run; the 10-minute run is in RESULTS.md
