"""Which steps keep their DDP bucket timeline (dpnb.engine.train.train_state.records_buckets), and
the garbage collector around a train call (dpnb.engine.proc.process.scheduled_gc)."""

from dpnb.engine.train.train_state import RECORD_EVERY, records_buckets


def kept(record, default_on, first, n):
    return [first + i for i in range(n) if records_buckets(record, default_on, i, n, first + i)]


def test_the_default_keeps_every_tenth_step_and_the_calls_last():
    assert RECORD_EVERY == 10
    assert kept(None, True, 0, 25) == [0, 10, 20, 24]
    assert kept(None, True, 4, 12) == [10, 15]
    assert kept(None, True, 7, 1) == [7]  # a one-step call: its step is the last


def test_explicit_choices_and_recording_switched_off():
    assert kept(True, True, 3, 4) == [3, 4, 5, 6]
    assert kept(True, False, 3, 2) == [3, 4]  # asked for: kept even when the default is off
    assert kept(False, True, 0, 30) == []
    assert kept(None, False, 0, 30) == []


def test_the_collector_is_off_during_a_call_and_restored_after_even_on_an_error():
    import gc

    import pytest

    from dpnb.engine.proc.process import scheduled_gc

    assert gc.isenabled()
    with pytest.raises(ValueError):
        with scheduled_gc():
            assert not gc.isenabled()
            raise ValueError("a step failed")
    assert gc.isenabled()
    gc.disable()  # the user's own choice survives a call
    try:
        with scheduled_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
