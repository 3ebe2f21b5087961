"""The session's setup record: typed steps, read back from the JSON a kept cluster holds.

A kept cluster's record (dpnb.cluster.keep) carries ``setup_log`` entries as an
older dpnb wrote them (kind, label, code, dotted, args, kwargs).  They must come
back as the typed steps resume replays and export writes, and be written again
unchanged, so a cluster kept before and attached after still resumes.
"""

import json

from dpnb.engine import entrypoints as ep
from dpnb.session.record import DataStep, LoadStep, SetupCell, SetupRecord, WatchStep, WrapStep

#: ``setup_log`` as dpnb wrote it before the session owned the record (2026-11-26)
OLD_SETUP_LOG = [
    {"kind": "cell", "label": "cell: import torch (+1 lines)",
     "code": "import torch\nnet = torch.nn.Linear(2, 2)\n", "dotted": "", "args": [], "kwargs": {}},
    {"kind": "call", "label": "wrap net (zero1)", "code": "", "dotted": "dpnb.engine.training.wrap",
     "args": ["net", "zero1"], "kwargs": {"lr": 0.1, "bucket_cap_mb": 1}},
    {"kind": "call", "label": "gradsync timing hooks", "code": "",
     "dotted": "dpnb.engine.views.watch", "args": [], "kwargs": {}},
    {"kind": "call", "label": "data ds", "code": "", "dotted": "dpnb.engine.training.set_data",
     "args": ["ds"], "kwargs": {"seed": 3, "shuffle": False}},
]


def test_an_old_setup_log_reads_back_as_typed_steps_and_writes_the_same_json():
    rec = SetupRecord.from_record(json.loads(json.dumps(OLD_SETUP_LOG)))
    assert list(rec.entries) == [SetupCell("import torch\nnet = torch.nn.Linear(2, 2)\n"),
                                 WrapStep("net", "zero1", {"lr": 0.1, "bucket_cap_mb": 1}),
                                 WatchStep(), DataStep("ds", seed=3, shuffle=False)]
    # written back the same, the entry points by today's names (the engine's rooms)
    assert rec.to_record() == [dict(d, dotted=ep.RENAMED.get(d["dotted"], d["dotted"]))
                               for d in OLD_SETUP_LOG]
    assert [d["dotted"] for d in rec.to_record()[1:]] == [ep.WRAP, ep.WATCH, ep.SET_DATA]
    assert rec.wrapped and rec.last(DataStep).dataset == "ds"
    # what resume sends again: each call step's entry point and arguments, as recorded
    assert [s.call() for s in rec.calls()] == [
        (ep.WRAP, ("net", "zero1"), {"lr": 0.1, "bucket_cap_mb": 1}), (ep.WATCH, (), {}),
        (ep.SET_DATA, ("ds",), {"seed": 3, "shuffle": False})]


def test_an_unknown_step_in_a_record_is_left_out_not_fatal():
    rec = SetupRecord.from_record(OLD_SETUP_LOG[:1] + [
        {"kind": "call", "label": "x", "dotted": "dpnb.engine.gone.f", "args": [], "kwargs": {}}])
    assert len(rec) == 1 and not rec.wrapped


def test_a_load_is_kept_not_replayed_and_is_the_base_until_the_next_wrap():
    rec = SetupRecord.from_record(OLD_SETUP_LOG)
    assert rec.base() is None  # the freshly wrapped model
    rec.add(LoadStep("/ck/step-3", 3))
    back = SetupRecord.from_record(json.loads(json.dumps(rec.to_record())))
    assert list(back.entries) == list(rec.entries) and back.base() == LoadStep("/ck/step-3", 3)
    assert "load /ck/step-3 (step 3)" in back.describe()[-1]
    assert LoadStep("/ck/step-3", 3) not in back.calls()  # a resume loads its own checkpoint
    back.add(WrapStep("net2", "ddp"))
    assert back.base() is None  # a new model does not start from that checkpoint
