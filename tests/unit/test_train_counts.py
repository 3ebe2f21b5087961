"""train's counts are checked by one rule, on the notebook and on every rank.

The notebook refuses a bad ``--steps`` before sending anything; the ranks
refuse it again before their step loop, because ``cluster.call(ep.TRAIN)``
and an exported job reach them without the notebook.  Once the two had
different rules (``steps=0``: refused by the notebook, a silent no-op run on
the ranks); both now ask :func:`dpnb.core.traincounts.count_problem`.
"""

from __future__ import annotations

import types

import pytest

from dpnb.core.traincounts import count_problem
from dpnb.engine.train.train_state import TrainError
from dpnb.engine.train.trainplan import plan
from dpnb.core.errors import UserError
from dpnb.core.trainargs import TrainArgs
from dpnb.session import verbs
from dpnb.session.training_state import TrainingState

BAD = [dict(steps=0), dict(epochs=0), dict(steps=-2), dict(steps=True), dict(steps=1.5),
       dict(steps=3, micro_batch=0), dict(steps=3, grad_accum=0), dict(steps=3, micro_batch=True)]


def test_the_rule():
    assert count_problem(steps=1, epochs=None, micro_batch=8, grad_accum=1) is None
    assert count_problem(steps=0) == "--steps must be a whole number >= 1 (got 0)"
    assert count_problem(grad_accum=True) == "--grad-accum must be a whole number >= 1 (got True)"
    assert count_problem(micro_batch=None) is None  # not given: the default applies
    assert count_problem(("micro_batch",), micro_batch=None) is not None  # on the ranks it must be
    with pytest.raises(TypeError):
        count_problem(stepz=1)


def _engine(kw: dict) -> str:
    args = dict(steps=None, epochs=None, micro_batch=8, grad_accum=1, lr_scale="none",
                ref_batch=None, step_fn=None, loss_fn=None)
    args.update(kw)
    if args["steps"] is None and args["epochs"] is None:
        args["steps"] = 1
    with pytest.raises(TrainError) as e:  # raised before the rank looks at its data
        plan({}, None, None, TrainArgs(**args))
    return str(e.value)


def _notebook(kw: dict) -> str:
    cluster = types.SimpleNamespace(training=TrainingState())
    with pytest.raises(UserError) as e:  # raised before anything is sent
        verbs.train(cluster, TrainArgs(**kw))
    return str(e.value)


@pytest.mark.parametrize("kw", BAD, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_notebook_and_ranks_refuse_the_same_counts_with_the_same_line(kw):
    assert _notebook(kw) == _engine(kw) == count_problem(**{"steps": None, **kw})
