"""One cluster's world as one immutable value (dpnb/cluster/worldref.py), and the kept
record assembled from each part's own record (dpnb/cluster/keep.py), without a cluster."""

import dataclasses
import json
import types

import pytest

from dpnb.cluster import keep
from dpnb.cluster.launchers import from_record as launcher_from_record, launcher_for
from dpnb.cluster.worldref import World, WorldRef
from dpnb.cluster.types import CellRecord, EntryKind, LaunchSpec, RankInfo


def _ranks(n: int) -> list[RankInfo]:
    return [RankInfo(rank=r, engine_id=10 + r, host="h", ip="127.0.0.1", pid=100 + r,
                     local_rank=r, local_world_size=n, node_rank=0, device="cpu")
            for r in range(n)]


def test_a_world_is_replaced_whole_and_fresh_ranks_lose_their_doors():
    w = World(ranks=_ranks(3)).with_doors({0: ("/d0", 0), 1: ("/d1", 0), 2: ("/d2", 0)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.master_port = 5
    with pytest.raises(TypeError):
        w.doors[0] = ("elsewhere", 1)  # read-only: a new world, not an edit
    ref = WorldRef(w)
    new = ref.set(w.with_ranks(_ranks(2), fresh=[1]))  # rank 1 replaced, rank 2 gone
    assert ref.now is new and dict(new.doors) == {0: ("/d0", 0)} and new.size == 2
    assert dict(w.doors) == {0: ("/d0", 0), 1: ("/d1", 0), 2: ("/d2", 0)}  # the old one as it was
    formed = new.formed(29500, 4)
    assert (formed.master_port, formed.generation, formed.ranks) == (29500, 4, new.ranks)
    with pytest.raises(TypeError):
        ref.set({"ranks": []})


def test_the_world_the_history_and_the_launcher_come_back_from_their_records():
    w = World(ranks=_ranks(2)).with_doors({1: ("10.0.0.2", 4000)}).formed(29501, 3)
    assert World.from_record(json.loads(json.dumps(w.to_record()))) == w
    cell = CellRecord(EntryKind.CELL, "x = 1", (0,), ok=False, seq=7)
    assert CellRecord.from_record(json.loads(json.dumps(cell.to_record()))) == cell
    # an older dpnb's entry: no seq (its position is taken), a "setup" mark (the session's now)
    old = {"kind": "cell", "code": "x = 1", "ranks": None, "setup": True, "ok": True, "names": []}
    assert CellRecord.from_record(old, seq=3) == CellRecord(EntryKind.CELL, "x = 1", seq=3)
    launcher = launcher_from_record(launcher_for(LaunchSpec(env=(("A", "1"),))).to_record())
    assert launcher.spec.env == (("A", "1"),) and launcher.spec.kept


def _cluster(**parts):
    own = dict(cluster_id="1-a", created=1.0, profile_dir="/p", cluster_file="/p/c.json",
               history=[], world=World(ranks=_ranks(2)),
               group=types.SimpleNamespace(to_record=lambda: {"backend": "gloo"}),
               transport=types.SimpleNamespace(to_record=lambda: {"token": "t"}),
               engine_launcher=launcher_for(LaunchSpec()),
               session_record=lambda: {"setup_log": [], "train_log": []})
    return types.SimpleNamespace(**{**own, **parts})


def test_the_kept_record_is_each_part_s_own_record():
    rec = keep.record_of(_cluster(), 60.0)
    assert {"ranks", "master_port", "generation", "doors", "backend", "token", "env",
            "setup_log", "history", "train_log"} <= set(rec) and rec["ttl_s"] == 60.0
    # two parts writing one key would lose one of them: refused, not merged
    twice = _cluster(transport=types.SimpleNamespace(to_record=lambda: {"backend": "nccl"}))
    with pytest.raises(AssertionError, match="writes \\['backend'\\] again"):
        keep.record_of(twice, 60.0)
