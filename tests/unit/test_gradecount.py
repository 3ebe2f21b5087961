"""The grader counts communication below torch.distributed's Python names.

One process, a gloo world of one rank (a file store): every path a learner's
code takes to the wire -- ``dist.all_reduce``, the process group's own
``allreduce``, a functional collective, the ``*_object`` calls,
``all_to_all_single`` -- dispatches a ``c10d`` / ``_c10d_functional``
operator that :class:`dpnb.engine.gradecount.Counting` sees.  The unit tier
also runs under the oldest torch pyproject.toml allows
(``tests/slow/test_oldest_versions.py``), which holds the same there.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from dpnb.engine.gradecount import Counting, _counted  # noqa: E402


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_path_to_the_wire_is_counted_under_its_torch_distributed_name(world):
    import torch.distributed._functional_collectives as fc

    t = torch.ones(8)
    mode = Counting(0, 1)
    with mode:
        dist.all_reduce(t)
        dist.group.WORLD.allreduce([t]).wait()
        fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
        out = [None]
        dist.all_gather_object(out, {"a": 1})
        dist.broadcast(t, 0)
        dist.all_to_all_single(torch.empty(8), t)
    got = {k: v[0] for k, v in mode.counts.items()}
    assert got["all_reduce"] == 3, got  # the function, the group's method, the functional one
    assert got["broadcast"] == 1 and got["all_to_all_single"] == 1, got
    assert got.get("all_gather", 0) + got.get("all_gather_into_tensor", 0) >= 1, got
    assert mode.counts["all_reduce"][1] == 3 * 32  # each call's full buffer


def test_the_bytes_that_leave_a_rank():
    """A send its tensor; a gather's root nothing, the others their input; a
    scatter's root every piece but its own; the cell guard's header nothing."""
    t8, t4 = torch.ones(8), torch.ones(4)
    assert _counted("c10d::send", ([t8], None, 1, 0), 0, 2) == ("send", 32)
    assert _counted("c10d::send", ([t8], None, 1, 1 << 30), 0, 2) is None
    assert _counted("c10d::gather_", ([[t4, t4]], [t4], None, 0), 0, 2) == ("gather", 0)
    assert _counted("c10d::gather_", ([], [t4], None, 0), 1, 2) == ("gather", 16)
    assert _counted("c10d::scatter_", ([t4], [[t4, t4, t4]], None, 0), 0, 3) == ("scatter", 32)
    assert _counted("c10d::alltoall_base_", (t8, t8, None, [], []), 0, 4) == (
        "all_to_all_single", 24)
    assert _counted("_c10d_functional::wait_tensor", (t8,), 0, 2) is None
