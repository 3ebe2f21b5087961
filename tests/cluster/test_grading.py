"""``%dp grade`` on a live 4-rank cluster: a correct and several wrong answers per exercise.

The learner's function is defined in a cell on every rank, as in chapter 11,
then graded; each wrong answer must fail on the check its bug breaks (values,
bytes sent, memory held) or, for a crash, a deadlock, an endless loop or a
size mismatch, fail naming the cause -- with every engine alive and the next
grade working.  One 4-rank cluster for the module (1 torch thread each: 4
engines on 2 cores); the deadlock cases run at a 2 s case timeout, the group
timeout is torch's 30 min, so only dpnb's release ends them.
"""

from __future__ import annotations

import time

import pytest

import dpnb
from dpnb.session.grading import model_answer

QUICK = 2.0  # the case timeout for the deadlocks and loops below


@pytest.fixture(scope="module")
def _c4_module():
    c = dpnb.start(4, threads=1)
    c.run("import torch, torch.distributed as dist", display=False)
    yield c
    c.stop()


@pytest.fixture
def c4(_c4_module):
    """The module's four ranks, repaired after a test that left one dead, busy or
    the group broken: one failure stays one red test (a CI run once saw every test
    after a stuck rank refused with "rank 3 still running an earlier cell")."""
    c = _c4_module
    yield c
    c.transport.refresh_busy()
    if c.running and (c.dead or c.busy or not c.group_ok):
        c.restart()
        c.run("import torch, torch.distributed as dist", display=False)


def _define(c, code: str) -> None:
    c.run(code, display=False)


def _grade(c, key, code, name=None, **kw):
    _define(c, code)
    return c.grade(key, name or key, **kw)


def _failed(g) -> dict:
    """The checks that ran and failed (those a failed case left unrun say so, and score 0)."""
    assert g.points[1] == sum(c.points for c in g.checks)  # every planned check is there
    return {ch.name: ch for ch in g.checks if not ch.passed and ch.measured != "not run"}


def _run_failure(g):
    """The check a case that did not finish on every rank failed: its values check."""
    (check,) = [ch for ch in g.checks if ch.family == "runs"]
    assert check.name.startswith("values (") and not check.passed
    assert all(ch.measured == "not run" for ch in g.checks if ch.family != "runs" and not ch.passed)
    return check


def _alive(c) -> None:
    """Every engine kept, the group usable."""
    assert not c.dead and c.group_ok
    assert c.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", display=False).ok


# ----------------------------------------------------------------- ring all-reduce
RING_OFF_BY_ONE = model_answer("ring_allreduce").replace(
    "recv_c = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]",
    "recv_c = chunks[(rank - s) % n], chunks[(rank - s) % n]")

RING_SEND_TO_ALL = """
def ring_allreduce(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    reqs = [dist.isend(t.clone(), dst=j) for j in range(n) if j != rank]
    total = t.clone()
    for j in range(n):
        if j != rank:
            buf = torch.empty_like(t)
            dist.recv(buf, src=j)
            total += buf
    for r in reqs:
        r.wait()
    t.copy_(total)
"""

RING_CRASH = model_answer("ring_allreduce").replace(
    "    right, left =", "    if rank == 2:\n        raise ValueError('rank 2 lost its chunk')\n"
    "    right, left =")

RING_DEADLOCK = model_answer("ring_allreduce").replace(
    "req = dist.irecv(buf, src=left)\n        dist.send(send_c.contiguous(), dst=right)\n"
    "        req.wait()\n        recv_c += buf",
    "dist.recv(buf, src=left)\n        dist.send(send_c.contiguous(), dst=right)\n        recv_c += buf")

# the sender splits with tensor_split (258, 258, 257, 257 of 1030), the
# receiver's buffer with chunk (258, 258, 258, 256): gloo would abort
RING_SIZES = model_answer("ring_allreduce").replace(
    "buf = torch.empty_like(recv_c)\n        req = dist.irecv(buf, src=left)\n"
    "        dist.send(send_c.contiguous(), dst=right)\n        req.wait()\n        recv_c += buf",
    "buf = torch.empty_like(torch.chunk(t, n)[(rank - s - 1) % n])\n"
    "        req = dist.irecv(buf, src=left)\n        dist.send(send_c.contiguous(), dst=right)\n"
    "        req.wait()\n        recv_c += buf[:recv_c.numel()]")


def test_the_wrong_answers_differ_from_the_model_answer():
    """Each replace above took: a mutant equal to the answer would prove nothing."""
    answer = model_answer("ring_allreduce")
    for code in (RING_OFF_BY_ONE, RING_CRASH, RING_DEADLOCK, RING_SIZES):
        assert code != answer


def test_a_correct_ring_passes_with_the_ring_bytes(c4):
    g = _grade(c4, "ring_allreduce", model_answer("ring_allreduce"), "ring_allreduce")
    assert g.passed, g.report
    names = [ch.name for ch in g.checks]
    assert names.count("values (n=16)") == 1 and "values (n=4099)" in names
    assert "bytes sent" in names and "point-to-point only" in names
    # the model answer is shown after a pass
    assert "def ring_allreduce" in g.report and g.answer


def test_a_chunk_index_off_by_one_fails_on_values(c4):
    g = _grade(c4, "ring_allreduce", RING_OFF_BY_ONE, reveal=False)
    assert not g.passed
    bad = _failed(g)
    assert "values (n=16)" in bad, g.report
    assert "elements wrong" in bad["values (n=16)"].sentence
    assert not g.answer and "Hint 1" in g.report  # no answer without a pass
    _alive(c4)


def test_sending_every_tensor_to_every_rank_fails_naming_the_bytes(c4):
    g = _grade(c4, "ring_allreduce", RING_SEND_TO_ALL)
    bad = _failed(g)
    assert list(bad) == ["bytes sent"], g.report  # right values, too many bytes
    n, numel = 4, 4099
    assert f"{(n - 1) * numel * 4 / 1e3:.4g} kB" in bad["bytes sent"].sentence  # 3x the tensor
    assert "2.0 times as much as a ring's 2(N-1)/N = 1.50x" in bad["bytes sent"].sentence


def test_a_crash_on_one_rank_fails_naming_it_and_keeps_the_engines(c4):
    t0 = time.monotonic()
    # a case timeout far above the bound below: a release and a timeout cannot
    # both pass it (the default 8 s case timeout would sit right at the bound)
    g = _grade(c4, "ring_allreduce", RING_CRASH, timeout=60.0)
    took = time.monotonic() - t0
    assert not g.passed
    check = _run_failure(g)
    assert "rank 2 raised ValueError: rank 2 lost its chunk" in check.sentence
    # released, not timed out: the 60 s case timeout never ran out (group timeout 30 min)
    assert took < 15.0, took
    _alive(c4)


def test_a_deadlock_fails_as_a_deadlock_and_keeps_the_engines(c4):
    g = _grade(c4, "ring_allreduce", RING_DEADLOCK, timeout=QUICK)
    (check,) = _failed(g).values()
    assert check.sentence.startswith("deadlock: after 2 s every rank waited"), check.sentence
    assert "recv" in check.sentence
    _alive(c4)


def test_a_size_mismatch_fails_naming_the_sizes_instead_of_aborting_gloo(c4):
    pids = [r.pid for r in c4.ranks]
    g = _grade(c4, "ring_allreduce", RING_SIZES)
    assert _run_failure(g).sentence.startswith("sizes differ between a send and its recv"), g.report
    assert [r.pid for r in c4.ranks] == pids
    _alive(c4)


def test_an_endless_loop_is_interrupted(c4):
    code = "def ring_allreduce(t):\n    while True:\n        pass\n"
    g = _grade(c4, "ring_allreduce", code, timeout=QUICK)
    (check,) = _failed(g).values()
    assert "still ran their own code after 2 s" in check.sentence, check.sentence
    _alive(c4)


# ----------------------------------------------------------------- DDP comm hook
HOOK_SUM = model_answer("allreduce_hook").replace(".div_(n)", "")

HOOK_RETURNS_NONE = """
def allreduce_hook(state, bucket):
    dist.all_reduce(bucket.buffer())
    bucket.buffer().div_(dist.get_world_size())
"""

HOOK_DEADLOCK = model_answer("allreduce_hook").replace(
    "    buf = bucket.buffer()",
    "    dist.recv(torch.empty(1), src=(dist.get_rank() + 1) % dist.get_world_size())\n"
    "    buf = bucket.buffer()")


def test_a_correct_hook_passes(c4):
    g = _grade(c4, "allreduce_hook", model_answer("allreduce_hook"))
    assert g.passed, g.report
    assert {"returns a Future", "overlaps backward", "values (case 1)", "bytes sent"} \
        <= {ch.name for ch in g.checks}


HOOK_BLOCKING = """
def allreduce_hook(state, bucket):
    buf = bucket.buffer()
    dist.all_reduce(buf)  # waits: backward stands still while the bucket travels
    buf /= dist.get_world_size()
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut
"""


def test_a_hook_that_waits_for_its_all_reduce_fails_on_overlap(c4):
    g = _grade(c4, "allreduce_hook", HOOK_BLOCKING)
    bad = _failed(g)
    assert list(bad) == ["overlaps backward"], g.report  # right values, right bytes
    assert bad["overlaps backward"].measured.startswith("0 of ")
    assert "launch it with async_op=True" in bad["overlaps backward"].sentence


# the model answer, with its rank paused 0.1 s between the launch and the return
# (as the scheduler can pause a rank on a busy machine): it did not wait, so it
# overlaps.  A 7 kB all-reduce launched by every rank together is over by then,
# and a correct hook was once graded as waiting in a full test run.
HOOK_PAUSED_AFTER_LAUNCH = model_answer("allreduce_hook").replace(
    "    return fut.then(",
    "    import time\n    time.sleep(0.1)\n    return fut.then(")


def test_a_hook_paused_after_its_launch_still_overlaps(c4):
    assert "time.sleep(0.1)" in HOOK_PAUSED_AFTER_LAUNCH
    g = _grade(c4, "allreduce_hook", HOOK_PAUSED_AFTER_LAUNCH)
    assert g.passed, g.report


def test_a_hook_that_forgets_to_average_fails_on_values(c4):
    assert HOOK_SUM != model_answer("allreduce_hook")
    g = _grade(c4, "allreduce_hook", HOOK_SUM)
    bad = _failed(g)
    assert list(bad) == ["values (case 1)"], g.report
    assert "4.00x the gradient averaged over ranks" in bad["values (case 1)"].sentence


def test_a_hook_returning_no_future_fails_naming_it(c4):
    g = _grade(c4, "allreduce_hook", HOOK_RETURNS_NONE)
    (check,) = _failed(g).values()
    assert "not a torch.futures.Future" in check.sentence, check.sentence
    _alive(c4)


def test_a_deadlocking_hook_is_released(c4):
    g = _grade(c4, "allreduce_hook", HOOK_DEADLOCK, timeout=QUICK)
    (check,) = _failed(g).values()
    assert check.sentence.startswith("deadlock"), check.sentence
    _alive(c4)


# ----------------------------------------------------------------- ZeRO-1
ZERO1_FULL_STATE = """
def zero1_step(params, state, lr, momentum):
    n = dist.get_world_size()
    for i, p in enumerate(params):
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= n
        buf = state.get(i)
        buf = g if buf is None else buf.mul_(momentum).add_(g)
        state[i] = buf
        p.sub_(lr * buf)
"""

ZERO1_CRASH = model_answer("zero1_step").replace(
    "    flat = torch.cat(", "    if rank == 3:\n        state['oops'] = 1 / 0\n    flat = torch.cat(")


def test_a_correct_zero1_step_passes_holding_a_quarter_of_the_momentum(c4):
    g = _grade(c4, "zero1_step", model_answer("zero1_step"))
    assert g.passed, g.report
    mem = next(ch for ch in g.checks if ch.name == "optimizer state held")
    # the last case: 70 + 7 + 15 = 92 float32 momentum elements, 23 per rank (92/4)
    assert mem.measured.endswith("keeps 92 B of momentum"), mem.measured
    sent = next(ch for ch in g.checks if ch.name == "bytes sent")
    # reduce-scatter + all-gather of 92 floats: 2 x 3/4 x 368 B = 552 B from each rank
    assert sent.passed and "sent 552 B (1.50x)" in sent.measured, sent.measured


def test_a_zero1_step_keeping_the_whole_momentum_fails_on_memory(c4):
    g = _grade(c4, "zero1_step", ZERO1_FULL_STATE)
    bad = _failed(g)
    assert list(bad) == ["optimizer state held"], g.report
    assert "keeps the whole momentum (368 B)" in bad["optimizer state held"].sentence


ZERO1_ALL_REDUCE = model_answer("zero1_step").replace(
    "    mine = flat.new_empty(S)  # this rank's slice of the summed gradient\n"
    "    dist.reduce_scatter(mine, list(grad.chunk(n)))\n    mine /= n\n",
    "    dist.all_reduce(grad)\n    mine = grad[rank * S:(rank + 1) * S] / n\n")


def test_a_zero1_step_that_all_reduces_the_gradients_fails_on_bytes(c4):
    assert ZERO1_ALL_REDUCE != model_answer("zero1_step")
    g = _grade(c4, "zero1_step", ZERO1_ALL_REDUCE)
    bad = _failed(g)
    assert list(bad) == ["bytes sent"], g.report  # right values, 1/N of the state kept
    # all-reduce 2 x 3/4 x 368 B + all-gather 3/4 x 368 B = 828 B, 1.5 times the optimum
    assert "sent 828 B (2.25x)" in bad["bytes sent"].measured, bad["bytes sent"].measured


def test_a_zero1_crash_fails_naming_it(c4):
    assert ZERO1_CRASH != model_answer("zero1_step")
    g = _grade(c4, "zero1_step", ZERO1_CRASH)
    (check,) = _failed(g).values()
    assert "rank 3 raised ZeroDivisionError" in check.sentence, check.sentence
    _alive(c4)


def test_a_zero1_deadlock_is_released(c4):
    code = model_answer("zero1_step").replace("    dist.reduce_scatter(mine, list(grad.chunk(n)))",
                                              "    dist.recv(torch.empty(1), src=(rank + 1) % n)")
    assert code != model_answer("zero1_step")
    g = _grade(c4, "zero1_step", code, timeout=QUICK)
    (check,) = _failed(g).values()
    assert check.sentence.startswith("deadlock"), check.sentence
    _alive(c4)


# ----------------------------------------------------------------- ZeRO-2
def test_a_correct_zero2_step_passes_holding_a_quarter_of_gradients_and_momentum(c4):
    g = _grade(c4, "zero2_step", model_answer("zero2_step"))
    assert g.passed, g.report
    mem = next(ch for ch in g.checks if ch.name == "gradients and optimizer state held")
    # the last case: 92 float32 elements, 23 per rank: a gradient slice and a momentum slice
    assert mem.measured.endswith("keeps 184 B of gradients and momentum"), mem.measured


def test_a_zero1_step_graded_as_zero2_fails_keeping_the_full_gradients(c4):
    code = model_answer("zero1_step").replace("def zero1_step(", "def zero2_step(")
    g = _grade(c4, "zero2_step", code)
    bad = _failed(g)
    assert list(bad) == ["gradients and optimizer state held"], g.report  # right values, bytes
    assert "release them (p.grad = None)" in bad["gradients and optimizer state held"].sentence


def test_a_zero2_crash_and_deadlock_fail_naming_them(c4):
    crash = model_answer("zero2_step").replace(
        "    flat = torch.cat(", "    if rank == 2:\n        state['oops'] = 1 / 0\n    flat = torch.cat(")
    assert crash != model_answer("zero2_step")
    (check,) = _failed(_grade(c4, "zero2_step", crash)).values()
    assert "rank 2 raised ZeroDivisionError" in check.sentence, check.sentence
    stuck = model_answer("zero2_step").replace(
        "    dist.reduce_scatter(mine, list(grad.chunk(n)))",
        "    dist.recv(torch.empty(1), src=(rank + 1) % n)")
    assert stuck != model_answer("zero2_step")
    (check,) = _failed(_grade(c4, "zero2_step", stuck, timeout=QUICK)).values()
    assert check.sentence.startswith("deadlock"), check.sentence
    _alive(c4)


def test_hints_grow_with_each_failed_try_and_reveal_shows_the_answer(c4):
    c4.grade_tries.clear()
    first = _grade(c4, "zero1_step", ZERO1_FULL_STATE)
    second = c4.grade("zero1_step")
    assert len(first.hints) == 1 and len(second.hints) == 2 and not second.answer
    third = c4.grade("zero1_step", reveal=True)
    assert third.answer == model_answer("zero1_step") and not third.passed
    # another function for the same exercise is a first try again (its own hints)
    other = _grade(c4, "zero1_step", ZERO1_FULL_STATE.replace("def zero1_step(", "def step_v2("),
                   "step_v2")
    assert len(other.hints) == 1, other.report


def test_a_ring_that_calls_all_reduce_fails_point_to_point_only(c4):
    code = "def ring_allreduce(t):\n    dist.all_reduce(t)\n"
    g = _grade(c4, "ring_allreduce", code)
    bad = _failed(g)
    assert list(bad) == ["point-to-point only"], g.report  # right values, right bytes
    assert "all_reduce does the exercise for you" in bad["point-to-point only"].sentence


def test_the_magic_grades_the_sessions_cluster(c4):
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "dpnb")
    m = dpnb.magics.get_magics(ip)
    m.drop_warm()  # no zygote: this test starts nothing
    m.cluster = c4
    try:
        _define(c4, model_answer("allreduce_hook"))
        g = ip.run_line_magic("dp", "grade allreduce_hook")
        assert g.passed and g.exercise == "allreduce_hook" and g.world_size == 4, g
        g = ip.run_line_magic("dp", "grade ring_allreduce allreduce_hook --timeout 5")
        # a hook is not a ring: it fails, and the magic says so in its report
        assert not g.passed and g.exercise == "ring_allreduce", g
        bad = _failed(g)
        assert bad, g.report
        for ch in bad.values():  # each check that ran and failed: marked, and why
            assert f"FAIL {ch.name}:" in g.report, g.report
            assert ch.sentence and ch.sentence in g.report, (ch, g.report)
    finally:
        m.cluster = None


def test_grading_a_name_no_rank_defines_says_what_to_do(c4):
    from dpnb.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no_such_ring is not defined on rank\(s\) 0, 1, 2, 3: "
                                          r"define it in a %%dp cell \(ring_allreduce\(t\)\)"):
        c4.grade("ring_allreduce", "no_such_ring")
