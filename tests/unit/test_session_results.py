"""Train's arguments checked once, as one frozen config; the verbs' typed results.

``TrainArgs.checked`` is the one place the notebook validates a train call
(the counts by :mod:`dpnb.core.traincounts`, the lr rule, the checkpoint
interval and folder).  ``c.train`` / ``c.resize`` / ``c.export`` return frozen
dataclasses that notebooks still index as the dicts they used to be.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from dpnb.core.errors import UserError
from dpnb.session.results import ExportResult, TrainResult
from dpnb.core.events import TrainSummary
from dpnb.core.trainargs import TrainArgs


def test_train_args_checked_once_refuse_in_one_line_and_freeze():
    a = TrainArgs.checked(steps=3, micro_batch=8, grad_accum=1, checkpoint_every=2,
                          checkpoint_dir="~/ck")
    assert a.checkpoint_dir == os.path.expanduser("~/ck") and a.steps == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.steps = 4
    for kw, line in [(dict(micro_batch=8), "say how long to train"),
                     (dict(steps=0), "--steps must be a whole number >= 1 (got 0)"),
                     (dict(steps=1, lr_scale="cubic"), "--lr-scale must be one of"),
                     (dict(steps=1, checkpoint_every=True), "--checkpoint-every must be")]:
        with pytest.raises(UserError, match=line.replace("(", r"\(").replace(")", r"\)")):
            TrainArgs.checked(**kw)


def test_results_are_typed_and_still_indexed_like_the_dicts_they_were():
    summary = {"rank": 0, "steps": 2, "loss": 0.5, "losses": [0.7, 0.5], "global_batch": 16,
               "micro_batch": 8, "grad_accum": 1, "dp": 2, "first_step": 0, "last_step": 1}
    s = TrainResult.of(TrainSummary(**summary), batch_note="from %dp resize")
    assert s.loss == s["loss"] == 0.5 and s.get("batch_note") == "from %dp resize"
    assert s.get("nope") is None and "losses" in s and "nope" not in s
    with pytest.raises(KeyError):
        s["nope"]
    e = ExportResult(dir="/j", files=["train.py"], checkpoint="/j/checkpoint", step=3,
                     skipped=[], command="cd /j && ./run.sh")
    assert e["step"] == e.step == 3 and e.to_dict()["command"] == "cd /j && ./run.sh"
