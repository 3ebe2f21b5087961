"""The training session's typed state, and the kept-cluster record it reads and writes.

A cluster kept (``--keep``) by an earlier dpnb wrote the session's part of its
record as plain dicts; ``%dp attach`` must read those back into the same state,
and a record written now must have the same keys and values.
"""

from __future__ import annotations

import json

from dpnb.session.record import WrapStep
from dpnb.core.events import TrainSummary
from dpnb.core.trainargs import TrainArgs
from dpnb.session.training_state import (BatchPlan, LastTrain, TrainCall, TrainingState,
                                WrapRecord)

#: the session's keys of a record as dpnb wrote them before the session layer
#: (cluster/keep.py's record_of: c.train_log, c.last_wrap, c.batch_plan,
#: c.last_train without "progress", c.autosave_dir), after a wrap, two train
#: calls and a resize
OLD_RECORD = {
    "train_log": [
        {"steps": 3, "dp": 2, "micro_batch": 8, "grad_accum": 1, "lr_scale": "none",
         "ref_batch": None, "seq_len": None, "step_fn": None, "loss_fn": None},
        {"steps": 2, "dp": 3, "micro_batch": 8, "grad_accum": 2, "lr_scale": "linear",
         "ref_batch": 16, "seq_len": None, "step_fn": "my_step", "loss_fn": None},
    ],
    "last_wrap": {"model": "net", "strategy": "zero2", "lr": 0.01, "bucket_cap_mb": 1,
                  "summary": {"params": 1234, "strategy": "zero2"}},
    "batch_plan": {"micro_batch": 8, "grad_accum": 2, "global_batch": 48},
    "last_train": {"steps": 2, "epochs": None, "micro_batch": 8, "grad_accum": 2,
                   "lr_scale": "linear", "ref_batch": 16, "seq_len": None,
                   "step_fn": "my_step", "loss_fn": None, "record": None, "publish": True,
                   "checkpoint_every": 5, "checkpoint_dir": "/tmp/ck",
                   "summary": {"steps": 2, "last_step": 4, "global_batch": 48}},
    "autosave_dir": "/tmp/ck",
}


def test_an_old_record_reads_back_into_typed_state_and_writes_the_same_keys():
    st = TrainingState.from_record(json.loads(json.dumps(OLD_RECORD)))
    assert st.last_wrap == WrapRecord(WrapStep("net", "zero2", {"lr": 0.01, "bucket_cap_mb": 1}),
                                      {"params": 1234, "strategy": "zero2"})
    assert st.strategy == "zero2"
    assert st.batch_plan == BatchPlan(8, 2, 48)
    assert st.last_train.args.step_fn == "my_step" and st.last_train.args.checkpoint_every == 5
    assert st.last_train.summary["global_batch"] == 48
    assert [t.steps for t in st.train_log] == [3, 2] and st.steps_done == 5
    assert st.autosave_dir == "/tmp/ck"
    out = st.to_record()
    # the summary is typed now (TrainSummary): written whole, the old keys keep their values
    old_summary, new_summary = OLD_RECORD["last_train"]["summary"], out["last_train"].pop("summary")
    assert {k: new_summary[k] for k in old_summary} == old_summary
    assert TrainSummary.from_record(new_summary) == st.last_train.summary
    expected = json.loads(json.dumps(OLD_RECORD))
    del expected["last_train"]["summary"]
    assert out == expected


def test_a_record_without_the_session_keys_is_an_empty_session():
    st = TrainingState.from_record({"id": "x", "ranks": []})  # an older or bare record
    assert st == TrainingState()
    assert st.strategy == "ddp" and st.steps_done == 0
    assert st.to_record() == {"train_log": [], "last_wrap": None, "batch_plan": None,
                              "last_train": None, "autosave_dir": None}


def test_the_progress_payloads_are_not_kept():
    st = TrainingState(last_train=LastTrain(TrainArgs(steps=1), TrainSummary(steps=1),
                                            {0: {"rank": 0, "step": 0}}))
    assert "progress" not in st.to_record()["last_train"]
    assert TrainingState.from_record(st.to_record()).last_train.progress == {}


def test_the_peer_copy_interval_given_is_kept_for_an_attach():
    """``--peer-copy-every 5`` survives detach/attach: the attached session sets it on
    every rank, a replaced one included, so all copy at the same steps."""
    st = TrainingState.from_record(json.loads(json.dumps(TrainingState(peer_copy_every=5).to_record())))
    assert st.peer_copy_every == 5
    off = TrainingState.from_record(TrainingState(peer_copy_every=0).to_record())
    assert off.peer_copy_every == 0  # "off" is kept as off, not as the default


def test_a_new_wrap_starts_the_train_log_again():
    st = TrainingState(train_log=[TrainCall(steps=4, dp=2)])
    st.wrapped(WrapRecord(WrapStep("m", "ddp")))
    assert st.train_log == [] and st.last_wrap.model == "m"


def test_the_export_schedule_leaves_out_the_rank_count_and_unset_arguments():
    call = TrainCall.of(5, 4, TrainArgs(steps=5, micro_batch=8, grad_accum=2, step_fn="f"))
    assert call.schedule_entry() == {"steps": 5, "micro_batch": 8, "grad_accum": 2,
                                     "lr_scale": "none", "step_fn": "f"}
