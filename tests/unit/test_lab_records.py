"""What the JupyterLab sidebar is fed: a kernel's publication of its cluster and /api/dpnb/clusters' JSON.

No cluster here: a stand-in with the attributes :class:`dpnb.cluster.publish.Publication`
reads (ranks, health, last failure), and kept-cluster records written as
:func:`dpnb.cluster.keep.hold` writes them, in this test's own folders.
"""

import dataclasses
import json
import os
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from dpnb.cluster import publish
from dpnb.cluster.processes import start_time
from dpnb.cluster.types import CellResult, RankOutcome, Status
from dpnb.core import profile as P
from dpnb.core import profilesummary as PS
from dpnb.core.profilesummary import summarize
from dpnb.lab import act as lab_act
from dpnb.lab import clusters as lab
from dpnb.widgets import profile as V
from dpnb.core import labviews as LV
from helpers.labrecords import _cluster, _cuda_publication, _rank
from helpers.recorded import ddp_record, snapshots32


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(publish.PUBLISH_ENV, str(tmp_path / "pub"))
    monkeypatch.setenv("DPNB_STATE_DIR", str(tmp_path / "kept"))
    return tmp_path


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_cluster_publishes_a_private_record_that_follows_it_and_goes_at_stop(dirs):
    c = _cluster(os.getpid())
    pub = publish.Publication(c, period_s=0.05)
    path = dirs / "pub" / "1700000000-abcd.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(dirs / "pub").st_mode) == 0o700
    rec = json.loads(path.read_text())
    assert rec["kernel"]["pid"] == os.getpid() and rec["kernel"]["start"] == start_time(os.getpid())
    assert [(r["rank"], r["host"], r["device"], r["alive"]) for r in rec["ranks"]] == [
        (0, "h1", "cpu", True), (1, "h1", "cpu", True)]
    # the layer above's progress and a failed cell reach the file within the period
    pub.progress({"step": 7, "loss": 0.25, "samples_per_s": 100.0, "history": [[1, 2]]})
    c.dead[1] = "killed by SIGKILL"
    c.last_failure = CellResult(ranks=[0, 1], elapsed_s=1.0, outcomes={
        0: RankOutcome(0, Status.OK),
        1: RankOutcome(1, Status.ERROR, ename="ValueError", evalue="bad batch\nmore")})
    deadline = time.monotonic() + 10  # the loop looks every 0.05 s; 10 s only says "not hung"
    while time.monotonic() < deadline:
        rec = json.loads(path.read_text())
        if rec["progress"].get("step") == 7 and rec["last_error"]:
            break
        time.sleep(0.05)
    assert rec["progress"]["loss"] == 0.25 and "history" not in rec["progress"]
    assert rec["last_error"] == "rank 1: ValueError: bad batch"
    assert [r["alive"] for r in rec["ranks"]] == [True, False]
    c.running = False  # stopped: the loop removes the file
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists()


def test_records_of_dead_kernels_and_dead_ranks(dirs):
    d = dirs / "pub"
    c = _cluster(_gone_pid())
    pub = publish.Publication(c, period_s=60)
    [rec] = publish.published()
    assert [r["alive"] for r in rec["ranks"]] == [False, False]  # the engines' PIDs are gone
    pub.remove()
    assert publish.published() == []
    stale = json.loads(json.dumps({**rec, "id": "stale", "kernel": {"pid": _gone_pid(),
                                                                      "start": 1.0}}))
    (d / "stale.json").write_text(json.dumps(stale))
    assert publish.published() == [] and not (d / "stale.json").exists()


def test_error_summary():
    assert publish.error_summary(None) is None
    res = CellResult(ranks=[0, 1], elapsed_s=1.0, outcomes={
        0: RankOutcome(0, Status.DIED, died="engine killed by SIGKILL"),
        1: RankOutcome(1, Status.ERROR, ename="RuntimeError", evalue="peer gone")})
    assert publish.error_summary(res) == "rank 0: engine killed by SIGKILL (and 1 more)"


def _kept(dirs, cid: str, holder: int | None) -> None:
    prof = dirs / f"prof-{cid}"
    prof.mkdir()
    (prof / "keep.json").write_text(json.dumps(
        {"ttl_s": 3600, "owner_pid": holder, "owner_start": start_time(holder) if holder else None,
         "detached_at": None if holder else time.time() - 10}))
    (dirs / "kept").mkdir(exist_ok=True)
    (dirs / "kept" / f"{cid}.json").write_text(json.dumps({
        "id": cid, "created": time.time() - 60, "ttl_s": 3600, "profile_dir": str(prof),
        "ranks": [dict(_rank(0, os.getpid()).__dict__)], "backend": "gloo",
        "token": "SECRET-TOKEN", "doors": {"0": ["127.0.0.1", 5]},
        "last_train": {"summary": {"last_step": 3, "loss": 0.5, "samples_per_s": 9.0}}}))


def test_api_json_lists_kernel_and_kept_clusters_without_their_secrets(dirs):
    pub = publish.Publication(_cluster(os.getpid()), period_s=60)
    _kept(dirs, "1800000000-kept", None)
    out = lab.clusters()
    assert [(c["id"], c["source"], c["world_size"], c["alive"]) for c in out] == [
        ("1800000000-kept", "kept", 1, 1), ("1700000000-abcd", "kernel", 2, 2)]
    assert out[0]["holder"] is None and 3500 < out[0]["stops_in_s"] <= 3600
    assert out[0]["progress"] == {"step": 3, "loss": 0.5, "samples_per_s": 9.0}
    assert out[1]["holder"] == os.getpid() and out[1]["ranks"][1]["rank"] == 1
    # each live local rank's resident memory, read by the server (this process stands in)
    assert all(r["rss_mb"] > 1 for c in out for r in c["ranks"]), out
    text = json.dumps(out)
    assert "SECRET-TOKEN" not in text and "doors" not in text and "pid_start" not in text
    pub.remove()


def test_the_api_says_what_agents_may_do_and_did_but_not_where_the_door_is(dirs):
    summary = {"allowed": {"actions": True, "code": False}, "agents": [{"pid": 4242,
                                                                         "last_call": 1.0}],
               "actions": ["dpnb: agent (dpnb mcp, pid 4242) at 10:00:00: interrupt -> ok"]}
    door = SimpleNamespace(path="/private/agent-door.sock", summary=lambda: summary)
    pub = publish.Publication(_cluster(os.getpid(), agent_door=door), period_s=60)
    [c] = lab.clusters()
    assert c["agent"] == summary
    assert "agent-door.sock" not in json.dumps(lab.clusters())
    pub.remove()


def test_gpu_memory_per_rank_by_pid_from_nvidia_smi_plumbing(dirs, monkeypatch):
    """Plumbing (no GPU here): a stand-in ``nvidia-smi`` prints fixed per-process numbers;
    the API gives each live local CUDA rank its PID's (two contexts summed), CPU ranks
    none, and a CPU-only cluster never runs nvidia-smi.  On a GPU: tests/gpu."""
    bin_, calls = dirs / "bin", dirs / "calls"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(
        f"#!/bin/sh\necho \"$*\" >> {calls}\n"
        f"printf '{os.getpid()}, 300\\n{os.getpid()}, 12\\n7, 999\\n'\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    pub = publish.Publication(_cluster(os.getpid()), period_s=60)
    assert [r["gpu_mb"] for r in lab.clusters(lab.GpuMemory())[0]["ranks"]] == [None, None]
    assert not calls.exists()  # CPU ranks: nvidia-smi never runs
    pub.remove()
    c = _cluster(os.getpid())  # another id: the first record's thread may still remove its own
    c.cluster_id, c.ranks[0] = "1700000001-cuda", dataclasses.replace(c.ranks[0], device="cuda:0")
    pub = publish.Publication(c, period_s=60)
    assert _gpu_mb_once_read(lab.GpuMemory()) == [312.0, None]
    assert "--query-compute-apps=pid,used_memory" in calls.read_text()
    pub.remove()


def _gpu_mb_once_read(gpu, timeout=10.0):
    """The ranks' gpu_mb once the reading (started by the first listing, on its own
    thread) has come in; the first listing answers before it."""
    deadline = time.monotonic() + timeout
    while True:
        got = [r["gpu_mb"] for r in lab.clusters(gpu)[0]["ranks"]]
        if got[0] is not None or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_slow_gpu_query_never_holds_the_listing(dirs, monkeypatch):
    """A stand-in nvidia-smi that takes 3 s: every listing meanwhile answers at once
    (from the last reading), one query runs at a time, and its numbers come after."""
    bin_, calls = dirs / "bin", dirs / "calls"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\necho run >> {calls}\nsleep 3\n"
                                     f"printf '{os.getpid()}, 40\\n'\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: the stand-in is asked
    pub = _cuda_publication(os.getpid())
    gpu = lab.GpuMemory()
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        got = [r["gpu_mb"] for r in lab.clusters(gpu)[0]["ranks"]]
        took.append(time.monotonic() - t0)
        assert got == [None, None]  # nothing read yet: the query still sleeps
        time.sleep(0.3)
    assert max(took) < 1.0, took  # the 3 s query held none of them
    assert _gpu_mb_once_read(gpu) == [40.0, None]
    assert calls.read_text().count("run") == 1  # one query in flight, not one per listing
    pub.remove()


def test_actions_say_what_to_do_instead(dirs):
    pub = publish.Publication(_cluster(os.getpid()), period_s=60)
    _kept(dirs, "1800000000-held", os.getpid())  # held by a running kernel (this process)
    with pytest.raises(lab.ActionError, match="held by kernel .*: run %dp stop in its notebook"):
        lab.act("1700000000-abcd", "stop")
    with pytest.raises(lab.ActionError, match="only kept clusters"):
        lab.act("1700000000-abcd", "attach-code")
    assert lab.act("1800000000-held", "attach-code") == {"code": "%dp attach 1800000000-held"}
    with pytest.raises(lab.ActionError, match="unknown action"):
        lab.act("1800000000-held", "scale")
    with pytest.raises(KeyError):
        lab.act("nope", "stop")
    pub.remove()


def test_restart_resume_asks_what_the_magic_asks(dirs, monkeypatch):
    """Plumbing: the sidebar's "Restart --resume" on a free kept cluster attaches and asks
    ``restart(resume=True)``, as ``%dp restart --resume`` does, then lets go; a held one
    says which magic to run.  (The rebuild itself: tests/cluster/test_resume*.py.)"""
    _kept(dirs, "1800000000-held", os.getpid())
    with pytest.raises(lab.ActionError, match="run %dp restart --resume in its notebook"):
        lab.act("1800000000-held", "restart-resume")
    asked = []

    class Attached:
        def restart(self, **kw):
            asked.append(kw)
            return "rank 1 replaced; resumed at step 3"

    monkeypatch.setattr(lab_act.Cluster, "attach", staticmethod(lambda cid: Attached()))
    monkeypatch.setattr(lab_act.keeping, "release", lambda c: asked.append("let go"))
    assert lab_act.main(["restart-resume", "1800000000-held"]) == 0
    assert asked == [{"resume": True}, "let go"]


def test_interrupt_sends_sigint_to_the_live_local_ranks(dirs):
    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: (print('SIGINT', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        c = _cluster(child.pid)
        c.ranks = [_rank(0, child.pid), _rank(1, _gone_pid())]  # rank 1's engine is gone
        pub = publish.Publication(c, period_s=60)
        assert lab.act(c.cluster_id, "interrupt") == {"interrupted": [0]}
        assert child.wait(timeout=10) == 0 and child.stdout.read().strip() == "SIGINT"
        pub.remove()
    finally:
        child.kill()
        child.wait()


def _profiled(n: int, late: int) -> P.Profiled:
    """``n`` ranks entering one all-reduce, rank ``late`` 30 ms after the others."""
    def rank(r: int) -> P.RankTrace:
        a = 1000 + (30_000 if r == late else 0)
        return P.extract([
            {"ph": "X", "name": P.CLOCK_MARKER, "cat": "user_annotation", "ts": 0, "dur": 1, "tid": 1},
            {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 500, "tid": 1},
            {"ph": "X", "name": "c10d::allreduce_", "cat": "cpu_op", "ts": a, "dur": 5, "tid": 1},
            {"ph": "X", "name": "gloo:all_reduce", "cat": "user_annotation", "ts": a + 1,
             "dur": 60_000 - a, "tid": 2, "args": {"Input Dims": [[1024]], "Input type": ["float"]}}],
            rank=r, host="h")
    return P.Profiled(P.analyze([rank(r) for r in range(n)], n), "/p/dpnb-profiles/t", "cell")


def test_the_last_profile_is_published_in_the_cell_views_words(dirs):
    """None before a profiled cell; after, the file and the API carry the summary the
    session hands over: the view's own sentences (its straggler line among them), each
    rank's compute and exposed seconds, the folder and the merged trace's name."""
    c = _cluster(os.getpid())  # held here: the publication holds it weakly
    pub = publish.Publication(c, period_s=60)
    path = dirs / "pub" / "1700000000-abcd.json"
    assert json.loads(path.read_text())["last_profile"] is None
    assert lab.clusters()[0]["last_profile"] is None
    p = _profiled(2, late=1)
    pub.profile(summarize(p))
    pub.write()
    got = json.loads(path.read_text())["last_profile"]
    view = V.data(p)
    assert got["lines"] == V.summary(view)  # one wording: the cell's view prints these
    assert got["straggler"].startswith("Straggler: rank 1 entered 1 of 1 collectives last, "
                                       "typically 30.00 ms") and got["straggler"] in V.text(view)
    assert got["clock"] in V.text(view) and got["failure"] == ""
    assert (got["folder"], got["merged"], got["what"]) == ("/p/dpnb-profiles/t", "merged.json", "cell")
    assert [(r["rank"], r["compute_s"], r["exposed_s"]) for r in got["ranks"]] == [
        (s.rank, s.compute_s, s.exposed_s) for s in p.report.stats]
    assert got["ranks"][0]["exposed_s"] > 0.02  # rank 0 waited ~30 ms for rank 1
    assert abs(got["at"] - time.time()) < 600 and got["more_ranks"] == 0
    assert lab.clusters()[0]["last_profile"] == got
    pub.profile(None)  # a new profiled cell under way: the old one is not shown as the last
    pub.write()
    assert json.loads(path.read_text())["last_profile"] is None
    pub.remove()


def test_the_published_profile_is_bounded_and_carries_the_failure():
    """A large cluster's summary keeps MAX_RANKS ranks' numbers (the rest counted), a
    failed cell its note as the session wrote it, and never the traces' events."""
    p = _profiled(PS.MAX_RANKS + 6, late=3)
    p = dataclasses.replace(p, failure="ValueError: boom")
    s = summarize(p)
    assert len(s.ranks) == PS.MAX_RANKS and s.more_ranks == 6
    assert s.failure == "the cell failed: ValueError: boom (what ran before is shown)"
    assert len(json.dumps(s.as_dict())) < 12_000  # a few lines and two numbers per rank
    assert "aten::mm" not in json.dumps(s.as_dict())


def test_the_published_loss_curve_takes_each_step_once_and_follows_a_rollback():
    """The panel's curve: every step the payloads' history carries, once, in order;
    a resume that rolled back to step 3 (or a new model's step 0) drops what came
    after, so the curve goes on from there; at most CURVE_MAX points."""
    curve: list = []
    publish.extend_curve(curve, {"step": 2, "loss": 0.7,
                                 "history": [[0, 0.9, 5.0], [1, 0.8, 5.0], [2, 0.7, 5.0]]})
    publish.extend_curve(curve, {"step": 5, "loss": 0.4,
                                 "history": [[2, 0.7, 5.0], [3, 0.6, 5.0], [4, 0.5, 5.0], [5, 0.4, 5.0]]})
    assert curve == [[0, 0.9, 5.0], [1, 0.8, 5.0], [2, 0.7, 5.0], [3, 0.6, 5.0], [4, 0.5, 5.0],
                     [5, 0.4, 5.0]]
    publish.extend_curve(curve, {"step": 3, "loss": 0.65, "samples_per_s": 6.0})  # rolled back, redone
    assert curve == [[0, 0.9, 5.0], [1, 0.8, 5.0], [2, 0.7, 5.0], [3, 0.65, 6.0]]
    publish.extend_curve(curve, {"step": 0, "loss": 2.0, "history": []})  # a new model
    assert curve == [[0, 2.0, None]]
    publish.extend_curve(curve, {"history": [[i, 1.0, None] for i in range(1, 600)]})
    assert len(curve) == publish.CURVE_MAX and curve[-1] == [599, 1.0, None]


def test_the_last_steps_sync_and_memory_are_published_for_the_panels(dirs):
    """None before a train call; after, the file and the API carry the step's lanes of
    bars per rank and each rank's bytes measured beside the exact model, as
    dpnb.core.labviews reduced them (what the Lab panels draw)."""
    c = _cluster(os.getpid())
    pub = publish.Publication(c, period_s=60)
    path = dirs / "pub" / "1700000000-abcd.json"
    assert json.loads(path.read_text())["gradsync"] is None
    assert lab.clusters()[0]["memory"] is None
    sync = LV.sync_panel([ddp_record(0), ddp_record(1, shift=0.0002)], 2)
    mem = LV.memory_panel(_two_snapshots())
    pub.step_views(sync, mem)
    pub.write()
    got = json.loads(path.read_text())
    as_json = lambda x: json.loads(json.dumps(x.as_dict()))  # noqa: E731
    assert got["gradsync"] == as_json(sync) and got["gradsync"]["step"] == 5
    assert got["memory"] == as_json(mem) and got["memory"]["parts"] == ["params", "grads", "optimizer"]
    api = lab.clusters()[0]
    assert (api["gradsync"], api["memory"]) == (got["gradsync"], got["memory"])
    pub.step_views(None, None)  # a train call that recorded nothing: nothing stale shown
    pub.write()
    assert json.loads(path.read_text())["gradsync"] is None
    pub.remove()


def _two_snapshots() -> list[dict]:
    snaps = snapshots32("ddp")[:2]
    return [{**s, "world_size": 2} for s in snaps]


def test_the_publication_thread_and_a_caller_write_the_record_one_at_a_time(dirs):
    """Both write the same temporary file and rename it: unguarded, one rename found
    the other's file gone (CI: FileNotFoundError in a test's write after a profile)."""
    c = _cluster(os.getpid())
    pub = publish.Publication(c, period_s=0.0005)  # its thread rewrites at every change
    try:
        for i in range(1500):
            c.generation = i  # a new record each time: both sides write
            assert pub.write()
        assert json.loads(open(pub.path).read())["id"] == c.cluster_id
    finally:
        pub.remove()
