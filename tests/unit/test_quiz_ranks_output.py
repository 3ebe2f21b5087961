"""Fast tests of notebook-side helpers that need no cluster."""

import pytest
from hypothesis import given, settings, strategies as st

from dpnb.errors import RankSpecError
from dpnb.cluster.diagnose import group_identical, is_collective_error, user_line
from dpnb.cluster.render import render_streams
from dpnb.quiz import Question
from dpnb.ranks import format_ranks, parse_ranks


def test_quiz_feedback_explains_every_option():
    q = Question("2+2?", ("3", "4"), 1, ("3 is one short.", "2+2 is 4."))
    assert q.feedback(1) == (True, "Correct. 2+2 is 4.")
    ok, text = q.feedback(0)
    assert not ok and text == 'Not quite: the answer is "4". 3 is one short.'
    assert "b) 4" in q.text() and "Answer" not in q.text()  # Check gives it, not the text
    with pytest.raises(ValueError, match="one explanation per option"):
        Question("?", ("a", "b"), 0, ("only one",))
    with pytest.raises(ValueError, match="not an option index"):
        Question("?", ("a",), 3, ("x",))


def test_quiz_widget_gives_feedback_on_click():
    q = Question("Which shards optimizer state only?", ("ZeRO-1", "ZeRO-3"), 0,
                 ("Right: stage 1 shards optimizer state.", "Stage 3 shards everything."))
    box = q.widget()
    radio, button, out = box.children[1], box.children[2], box.children[3]
    button.click()
    assert "Pick an option first" in out.value
    radio.index = 1
    button.click()
    assert "Not quite" in out.value and "Stage 3 shards everything." in out.value
    radio.index = 0
    button.click()
    assert "Correct." in out.value


@pytest.mark.parametrize("spec,world,expected", [
    (None, 3, [0, 1, 2]), ("0", 3, [0]), ("0,2", 3, [0, 2]), ("1:", 4, [1, 2, 3]),
    (":2", 4, [0, 1]), ("1:3", 4, [1, 2]), ("0-2", 4, [0, 1, 2]), ("all", 2, [0, 1]),
    ("2,0,2", 3, [0, 2]), (1, 2, [1]), ([1, 0], 2, [0, 1]),
])
def test_parse_ranks(spec, world, expected):
    assert parse_ranks(spec, world) == expected


@pytest.mark.parametrize("spec", ["3", "a", "1:1", "0-", "2-1", "0,,x", "-1", "1:2:3:4"])
def test_parse_ranks_rejects(spec):
    with pytest.raises(RankSpecError):
        parse_ranks(spec, 3)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12), st.integers(min_value=1, max_value=8))
def test_parse_ranks_only_valid_ranks_or_clear_error(spec, world):
    try:
        ranks = parse_ranks(spec, world)
    except RankSpecError as e:
        assert "rank" in str(e)
    else:
        assert ranks and ranks == sorted(set(ranks)) and all(0 <= r < world for r in ranks)


def test_format_ranks():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([3]) == "3"


def test_grouping_and_rendering():
    assert group_identical({0: "a", 1: "b", 2: "a"}) == [([0, 2], "a"), ([1], "b")]
    assert render_streams({0: "x\n", 1: "x\n"}, 2) == "[all 2 ranks]\nx\n"
    assert render_streams({0: "x\n", 1: ""}, 2) == "[rank 0]\nx\n"
    assert render_streams({0: "", 1: ""}, 2) == ""


def test_user_line_and_collective_classification():
    tb = ("\x1b[31mValueError\x1b[0m  Traceback\nCell In[12], line 3\n      1 a = 1\n"
          "      2 b = 2\n----> 3 raise ValueError('x')\n\nValueError: x")
    assert user_line(tb) == "cell line 3: raise ValueError('x')"
    assert is_collective_error("DistBackendError", "anything")
    assert is_collective_error("RuntimeError",
                               "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting")
    assert not is_collective_error("ValueError", "Timed out")
    assert not is_collective_error("RuntimeError", "shape mismatch")
