"""The pure half of ``%dp grade``: the checks' verdicts and sentences from
measured numbers, the hints and the hidden answers.  What the ranks measure
is tested on a live cluster in ``tests/cluster/test_grading.py``."""

from __future__ import annotations

import json

import pytest

from dpnb.core import grading as g
from dpnb.core.errors import ConfigError
from dpnb.session.grading import model_answer
from helpers.nbutil import REPO


def test_ring_bytes_pass_at_the_optimum_and_send_to_all_fails_saying_twice():
    n, size = 4, 4000
    ring = 2 * (n - 1) / n * size  # 6000: each rank sends 2(N-1) chunks of size/N
    ok = g.bytes_check({r: int(ring) for r in range(n)}, size, n, "tensor")
    assert ok.passed
    naive = g.bytes_check({0: int(ring), 1: (n - 1) * size}, size, n, "tensor")
    assert not naive.passed and naive.measured.startswith("rank 1 sent")
    assert "2.0 times as much as a ring's 2(N-1)/N = 1.50x" in naive.sentence
    assert "costs N-1 = 3 times the tensor (12 kB)" in naive.sentence


def test_sent_bytes_count_sends_and_cost_collectives_as_rings():
    n = 4
    ops = {"send": [3, 300], "recv": [3, 0], "all_reduce": [1, 4000],
           "all_gather_into_tensor": [1, 800], "gather": [1, 32], "all_to_all": [1, 48]}
    assert g.sent_bytes(ops, n) == 300 + 2 * 3 / 4 * 4000 + 3 / 4 * 800 + 32 + 48


def test_values_name_a_scaled_result_as_a_multiple_and_others_by_count():
    scaled = g.values_check("case 1", {0: {"bad": 10, "numel": 10, "max_err": 3.0, "ratio": 4.0,
                                           "scaled": True}}, "the average", "divide")
    assert not scaled.passed and "rank 0's result is 4.00x the average: divide" == scaled.sentence
    mixed = g.values_check("n=16", {0: {"bad": 0, "numel": 16, "max_err": 0.0, "ratio": 1.0},
                                    1: {"bad": 4, "numel": 16, "max_err": 2.5, "ratio": 0.8,
                                        "scaled": False}}, "the sum", "a chunk")
    assert "rank 1 has 4 of 16 elements wrong (largest error 2.5)" in mixed.sentence
    assert g.values_check("x", {0: {"bad": 0, "numel": 5, "max_err": 0, "ratio": 1}},
                          "s", "w").passed


def test_zero1_memory_is_a_quarter_of_ddps_momentum_at_four_ranks():
    shapes = [(13,), (6, 3)]  # 31 float32 elements: 124 B of momentum under DDP
    assert g.memory_check({0: 32, 1: 32, 2: 32, 3: 28}, shapes, 4).passed  # ceil(31/4) = 8
    full = g.memory_check({0: 124, 1: 124}, shapes, 4)
    assert not full.passed and "keeps the whole momentum (124 B)" in full.sentence
    assert "1/4" in full.expected
    assert "must survive" in g.memory_check({0: 0}, shapes, 4).sentence


def test_zero2_memory_is_a_quarter_of_ddps_gradients_and_momentum_at_four_ranks():
    shapes = [(13,), (6, 3)]  # 31 float32 elements: 124 B of gradients + 124 B of momentum
    # a slice of the averaged gradient and one of the momentum: 2 x 8 elements per rank
    ok = g.memory_check({0: 64, 1: 64, 2: 64, 3: 56}, shapes, 4, grads=True)
    assert ok.passed and ok.name == "gradients and optimizer state held", ok
    assert "1/4 of 124 B of gradients + 124 B of momentum" in ok.expected
    # ZeRO-1's step: the momentum sharded, the full .grad left on the params
    kept = g.memory_check({0: 124 + 32, 1: 124 + 32}, shapes, 4, grads=True)
    assert not kept.passed and "release them (p.grad = None)" in kept.sentence, kept
    # the same bytes pass as ZeRO-1's momentum check would not be asked: names differ
    assert g.memory_check({0: 32}, shapes, 4).name == "optimizer state held"


@pytest.mark.parametrize("outcomes,start", [
    ([{"rank": 0, "status": "error", "ename": "PointToPointMismatchError",
       "evalue": "rank 0's recv expects 3 from rank 1: sizes differ", "released": False}],
     "sizes differ between a send and its recv -- rank 0's recv expects 3 from rank 1"),
    ([{"rank": 2, "status": "error", "ename": "ValueError", "evalue": "boom"},
      {"rank": 0, "status": "error", "ename": "DistBackendError", "evalue": "x", "released": True}],
     "rank 2 raised ValueError: boom"),
    ([{"rank": r, "status": "timeout", "ename": "", "evalue": "", "collective": "recv with rank 1"}
      for r in range(2)], "deadlock: after 3 s every rank waited for a peer (rank 0 in recv with "
                          "rank 1; rank 1 in recv with rank 1) -- every rank waits in recv and none"),
    ([{"rank": r, "status": "timeout", "ename": "", "evalue": "", "collective": "send with rank 0"}
      for r in range(2)], "deadlock: after 3 s every rank waited for a peer (rank 0 in send with "
                          "rank 0; rank 1 in send with rank 0) -- every rank is in a blocking send"),
    ([{"rank": 0, "status": "timeout", "ename": "", "evalue": "", "collective": ""}],
     "rank(s) 0 still ran their own code after 3 s -- an endless loop?"),
])
def test_a_case_that_did_not_finish_is_named_by_its_cause(outcomes, start):
    assert g.failure_cause(outcomes, 3.0).startswith(start)


def _all_passed(ex):
    from dpnb.core.assignment import planned_checks
    return [g.Check(c.name, True, "ok", "ok") for c in planned_checks(ex)]


def test_hints_grow_with_tries_and_the_answer_waits_for_a_pass_or_reveal():
    ex = g.exercise("zero1_step")
    good = _all_passed(ex)
    bad = [g.Check("optimizer state held", False, "full", "1/N", "wrong")] + good[:-1]
    assert g.make_grade(ex, "f", 4, bad, tries=1, answer="ANSWER-TEXT").hints == \
        ex.hints_for("memory")[:1]
    second = g.make_grade(ex, "f", 4, bad, tries=2, answer="ANSWER-TEXT")
    assert len(second.hints) == 2 and second.answer == "" and "ANSWER-TEXT" not in second.report
    assert g.make_grade(ex, "f", 4, bad, tries=1, answer="ANSWER-TEXT", reveal=True).answer == "ANSWER-TEXT"
    passed = g.make_grade(ex, "f", 4, good, tries=5, answer="ANSWER-TEXT")
    assert passed.passed and passed.answer == "ANSWER-TEXT" and not passed.hints
    rec = json.loads(json.dumps(second.to_record()))
    assert (rec["points"], rec["max_points"]) == (3, 4)
    held = next(c for c in rec["checks"] if c["name"] == "optimizer state held")
    assert held["feedback"] == "wrong" and held["points"] == 0
    assert "<table>" in second._repr_html_() and str(second) == second.report


def test_a_hint_belongs_to_the_check_that_failed():
    """A hook that waits for its all-reduce fails only the overlap check: its
    first hint is about returning at once, not about averaging."""
    ex = g.exercise("allreduce_hook")
    checks = [c if c.name != "overlaps backward" else
              g.Check(c.name, False, "0 of 2", "some in flight", "waited") for c in _all_passed(ex)]
    gr = g.make_grade(ex, "f", 2, checks, tries=1)
    assert gr.hints == ex.hints_for("overlap")[:1] and "async_op=True" in gr.hints[0]
    assert "average" not in gr.hints[0]


def test_every_planned_check_counts_whether_it_ran_or_not():
    """The same maximum for every submission: a crash in case 1 leaves the other
    checks failed, not absent, each saying why."""
    ex = g.exercise("ring_allreduce")
    crashed = g.make_grade(ex, "f", 2, [g.run_check("n=16", "rank 1 raised ValueError")],
                           tries=1, why_missing="not run: n=16 did not finish on every rank.")
    full = g.make_grade(ex, "f", 2, _all_passed(ex), tries=1)
    assert crashed.points == (0, full.points[1]) == (0, 5)
    assert [c.name for c in crashed.checks] == [c.name for c in full.checks]
    assert crashed.checks[0].sentence == "rank 1 raised ValueError"
    assert all(c.sentence.startswith("not run: n=16") for c in crashed.checks[1:])
    assert g.BUILTIN.max_points == 13  # chapter 11's three exercises, every check one point


def test_a_rank_that_sent_nothing_fails_the_bytes_check():
    """Correct values with 0 bytes counted means communication the counter did not see."""
    c = g.bytes_check({0: 0, 1: 6000}, 4000, 2, "tensor")
    assert not c.passed and "no byte sent was counted on rank(s) 0" in c.sentence


def test_every_exercise_states_its_signature_and_has_a_hidden_model_answer():
    nb_sources = "\n".join(p.read_text() for p in (REPO / "notebooks").glob("*.ipynb"))
    for key, ex in g.EXERCISES.items():
        assert ex.signature.startswith(key + "(")
        answer = model_answer(key)
        assert f"def {key}(" in answer
        body = max(answer.splitlines(), key=len).strip()  # the answer's longest line
        assert body not in nb_sources, key
        assert len(ex.hints) >= 3
    with pytest.raises(ConfigError, match="use one of ring_allreduce"):
        g.exercise("ring")
