"""The benchmark suite still runs: every benchmark, tiny sizes, one round.

Speed is never asserted here (timings live in ``benchmarks/``); what is
asserted is that each comparison ran both of its sides and produced
numbers, and that ``%dp train`` and the plain torchrun loop trained the
same thing (equal final losses for every model and strategy).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHES = {"startup", "roundtrip", "train", "allreduce", "instrumentation", "scaling"}



@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    before = open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read()
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--smoke",
                        "--json", str(out)], capture_output=True, text=True, timeout=280,
                       cwd=str(out.parent))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read() == before, \
        "a smoke run must not overwrite RESULTS.md"
    return json.loads(out.read_text()), p.stdout


@pytest.mark.timeout(300)
def test_every_benchmark_ran_both_sides(smoke):
    data, stdout = smoke
    assert not data["failed"]
    assert set(data["timings_s"]) == BENCHES
    by_bench = {}
    for row in data["rows"]:
        by_bench.setdefault(row["bench"], []).append(row)
        for side in ("a", "b"):
            assert row[side]["n"] >= 1 and row[side]["median"] > 0, row
        assert row["ratio"] is not None and row["ratio"] > 0, row
    assert set(by_bench) == {"start-up", "cell round trip", "training step", "all-reduce busbw",
                             "instrumentation", "scaling"}
    # dpnb start, and accelerate's notebook_launcher for the first and second call
    # ready group, first step cold, first step after %load_ext (warm zygote), second step
    assert len(by_bench["start-up"]) == 4
    assert any("after %load_ext" in r["metric"] for r in by_bench["start-up"])
    assert len(by_bench["training step"]) == 2 * 2 * 4  # 2 models x 4 strategies, 2 metrics
    m = data["machine"]
    assert m["world_size"] == 2 and m["backend"] in ("gloo", "nccl") and m["torch"]
    # the printed table carries the machine line and every row
    assert "world size 2" in stdout and stdout.count("| training step |") >= 16


@pytest.mark.timeout(300)
def test_dpnb_and_torchrun_train_the_same_thing(smoke):
    data, _ = smoke
    losses = [r["extra"]["final_loss"] for r in data["rows"] if "final_loss" in r["extra"]]
    assert len(losses) == 8
    for fl in losses:
        assert fl["same"], fl
        assert abs(fl["dpnb"] - fl["torchrun"]) <= 1e-4 * max(1.0, abs(fl["torchrun"]))


@pytest.mark.timeout(240)
def test_loop_ab_runs_two_revisions_of_the_loop_in_one_engine():
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "loop_ab.py"), "--old",
                        "HEAD", "--backend", "gloo", "--rounds", "1", "--steps", "3",
                        "--warm", "1", "--tiny"], capture_output=True,
                       text=True, timeout=220, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rows = [line.split("|")[1:5] for line in p.stdout.splitlines()
            if line.startswith(("| mlp |", "| tinylm |"))]
    assert [r[0].strip() for r in rows] == ["mlp", "tinylm"], p.stdout
    for _, rev, now, ratio in rows:
        assert float(rev) > 0 and float(now) > 0
        assert float(ratio) == pytest.approx(float(now) / float(rev), rel=0.01)
