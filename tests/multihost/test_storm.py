"""A short storm across two namespace hosts (``benchmarks/storm.py``; its long
runs are in benchmarks/RESULTS.md): DDP on 2 + 2 ranks trains in calls of 20
steps while a fault lands every 8 seconds, the kinds in turn -- one rank
SIGKILLed from outside (the OOM killer's way), both ranks of the second host
at once (a lost machine), a rank frozen with SIGSTOP and continued 4 s later,
a cell that raises on one rank while the others wait in an ``all_reduce`` --
each recovered the way a user would (``restart --resume`` from the survivors'
memory after a death, and after a rank named frozen -- the restart replaces
it; nothing after a mistake or a freeze that ended before it was named).
The cluster keeps one spare engine per host (``--spares 1``): a rank killed
alone is replaced by its host's spare.

Every fault is healed (a training call completed after it) within a bound
that only says "not a timeout", a death is named by its rank, DDP loses no
step but the one in flight, the replicas agree at the end, and no process of
either host's is left.  What the user's ``%dp incidents`` shows of the same run
names each death the storm caused, and draws the steps across it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)


def _storm_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "storm.py"
    spec = importlib.util.spec_from_file_location("dpnb_storm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up by name)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_storm_heals_every_fault_loses_no_step_and_leaves_nothing(two_hosts):
    storm = _storm_module()
    args = storm.parse(["--minutes", "0.75", "--every", "8", "--strategies", "ddp", "--no-calm",
                        "--cycle", "--freeze-s", "4", "--seed", "3"])
    out = storm.storm(args, hs=two_hosts, log=print)
    [phase] = out["phases"]
    faults = phase["faults"]
    assert {f["kind"] for f in faults} == set(storm.KINDS), faults  # every kind landed
    for f in faults:
        assert f["healthy_after_s"] is not None and f["healthy_after_s"] < 60, f
        assert f["steps_lost"] is not None and f["steps_lost"] <= 1, f  # DDP: the step in flight
        if f["kind"] in ("kill", "host"):
            named = [f"rank {r}" for r in f["ranks"]] if f["kind"] == "kill" else ["ranks 2-3"]
            assert any(n in f["said"] for n in named) or "died" in f["said"], f
            assert f["how"].startswith("restart --resume"), f
        if f["kind"] == "kill":  # --spares 1 (the default): its host's spare took its place
            assert "by a spare engine" in f["how"], f
    assert phase["steps"] > 0 and len(phase["calls"]) >= 3
    # the user's own %dp incidents after the storm: every death the storm caused is
    # on it, naming the rank, seen soon after it landed; the steps drawn span the storm
    seen = out["incidents_seen"]["ddp"]
    died = [(r["ranks"], seen["created"] + r["at_s"]) for r in seen["rows"] if r["kind"] == "died"]
    for f in faults:
        if f["kind"] in ("kill", "host"):
            landed = phase["began"] + f["at_s"]
            for rank in f["ranks"]:
                assert any(rank in rs and -1 <= at - landed <= 15 for rs, at in died), (f, died)
    assert all(r["healthy_after_s"] is not None for r in seen["rows"]), seen["rows"]
    first_fault = phase["began"] - seen["created"] + min(f["at_s"] for f in faults)
    last_fault = phase["began"] - seen["created"] + max(f["at_s"] for f in faults)
    assert seen["drawn_s"][0] < first_fault and seen["drawn_s"][1] > last_fault, seen
    assert seen["steps_drawn"] >= phase["steps"] // 2, seen  # thinned only past 4000
    assert out["processes_left"]["here"] == [], out["processes_left"]
    assert all(n == 0 for h, n in out["processes_left"].items() if h != "here"), out
