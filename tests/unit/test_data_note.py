"""The uneven-data note (``DataState.usage_note``) comes with the call that
reaches the end of an epoch, where samples are dropped -- not with a short
call that drops nothing (the quick start's 20 steps over 20,233 samples)."""

from dpnb.engine.train.train_state import DataState

N = 20_233  # the quick start's dataset: 2 ranks x micro-batch 32 leave 9 of it over


def _state():
    return DataState(dataset=list(range(N)), name="d", seed=0, shuffle=False)


def test_a_call_that_ends_before_the_epoch_does_is_not_told():
    d = _state()
    assert d.usage_note(32, 1, 2, call_steps=20) is None
    # nothing was said, so the call that does reach the end still says it
    per_rank_steps = (N // 2) // 32  # 316 whole steps to an epoch
    assert d.usage_note(32, 1, 2, call_steps=per_rank_steps - 1) is None
    note = d.usage_note(32, 1, 2, call_steps=per_rank_steps)
    assert note.startswith(f"an epoch uses {per_rank_steps * 64} of the {N} samples and drops 9:")


def test_the_call_reaching_the_end_from_where_the_last_one_stopped_is_told_once():
    d = _state()
    d.offset = 300 * 64  # 300 steps done: 16 whole steps left in this epoch
    assert d.usage_note(32, 1, 2, call_steps=15) is None
    assert d.usage_note(32, 1, 2, call_steps=16) is not None
    assert d.usage_note(32, 1, 2, call_steps=400) is None  # once per setting
