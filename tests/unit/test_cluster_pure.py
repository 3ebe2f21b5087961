"""The notebook side's pure parts, without engines: rank layout, exit wording,
failure diagnosis, the setup log that ``restart --resume`` replays."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from dpnb.cluster.diagnose import classify, first_error, plain_user_error, remote_error
from dpnb.cluster.gpuplan import choose_backend, with_devices
from dpnb.cluster.launch import rank_init_info
from dpnb.cluster.placement import assign_ranks
from dpnb.cluster.processes import describe_exit
from dpnb.session.record import DataStep, SetupCell, SetupRecord, WrapStep
from dpnb.cluster.types import CellResult, RankOutcome
from dpnb.errors import DpnbError


def _probe(host, pid=100, cuda=0):
    return {"host": host, "ip": f"10.0.0.{len(host)}", "pid": pid, "cuda_devices": cuda}


def test_assign_ranks_contiguous_per_host_ordered_by_lowest_engine_id():
    # engine ids interleave the hosts; ranks must not
    probes = {3: _probe("b"), 0: _probe("a"), 1: _probe("b"), 2: _probe("a"), 5: _probe("c")}
    ranks = assign_ranks(probes)
    assert [(r.rank, r.engine_id, r.host, r.local_rank, r.node_rank) for r in ranks] == [
        (0, 0, "a", 0, 0), (1, 2, "a", 1, 0),
        (2, 1, "b", 0, 1), (3, 3, "b", 1, 1),
        (4, 5, "c", 0, 2)]
    assert [r.local_world_size for r in ranks] == [2, 2, 2, 2, 1]


def test_hosts_follow_the_order_the_user_gave_not_who_registered_first():
    # node-b's engines registered first (lower ids); the user listed node-a first
    probes = {0: dict(_probe("nb"), location="node-b"), 1: dict(_probe("nb"), location="node-b"),
              2: dict(_probe("na"), location="node-a"), 3: dict(_probe("na"), location="node-a")}
    ranks = assign_ranks(probes, host_order=["node-a", "node-b"])
    assert [(r.rank, r.host, r.engine_id, r.local_rank, r.node_rank) for r in ranks] == [
        (0, "na", 2, 0, 0), (1, "na", 3, 1, 0), (2, "nb", 0, 0, 1), (3, "nb", 1, 1, 1)]
    from dpnb.cluster.placement import host_layout

    assert host_layout(ranks) == "na: ranks 0-1, nb: ranks 2-3"
    # Slurm / MPI: the launcher's own rank (nodelist / hostfile order) decides
    for eid, lr in zip((0, 1, 2, 3), (3, 2, 1, 0)):
        probes[eid]["launch_rank"] = lr
    ranks = assign_ranks(probes, by_launch_rank=True)
    assert [r.engine_id for r in ranks] == [3, 2, 1, 0] and ranks[0].host == "na"
    probes[0]["launch_rank"] = 1  # not distinct: fall back to engine ids
    assert [r.engine_id for r in assign_ranks(probes, by_launch_rank=True)] == [0, 1, 2, 3]


def test_backend_auto_needs_a_gpu_per_engine_on_every_host():
    probes = {0: _probe("a", cuda=2), 1: _probe("a", cuda=2), 2: _probe("b", cuda=1),
              3: _probe("b", cuda=1)}
    ranks = assign_ranks(probes)
    assert choose_backend("auto", ranks, probes, None) == "gloo"  # host b: 2 engines, 1 GPU
    with pytest.raises(DpnbError, match="host b runs 2 engines and has 1 GPUs"):
        choose_backend("nccl", ranks, probes, None)
    two = {0: _probe("a", cuda=2), 1: _probe("a", cuda=2)}
    r2 = assign_ranks(two)
    assert choose_backend("auto", r2, two, None) == "nccl"
    devs = with_devices(r2, "nccl", [1, 0])
    # --gpus 1,0 as a torchrun user does it: both engines shown "1,0", each
    # driving cuda:<local_rank> of that list (so LOCAL_RANK names its GPU)
    assert [(d.device, d.visible_devices) for d in devs] == [("cuda:0", "1,0"), ("cuda:1", "1,0")]
    info = rank_init_info(devs[0], world_size=2, backend="nccl", master_addr="x", master_port=5,
                          timeout_s=3.0, threads=1, local=True, watch_ppid=None)
    assert info["device_index"] == 0 and info["local_rank"] == 0 and info["master_port"] == 5
    assert info["visible_devices"] == "1,0" and info["device_fallback"] == 1


def test_describe_exit():
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(-signal.SIGKILL).startswith("killed by signal 9 (SIGKILL)")
    assert "out of memory or kill -9" in describe_exit(-9)
    assert describe_exit(-signal.SIGABRT) == "killed by signal 6 (SIGABRT)"
    assert describe_exit(None) == "process gone, exit status unknown"


def _res(**by_rank) -> CellResult:
    outcomes = {}
    for key, o in by_rank.items():
        r = int(key[1:])
        outcomes[r] = RankOutcome(rank=r, **o)
    return CellResult(ranks=sorted(outcomes), outcomes=outcomes, elapsed_s=1.5)


TB = ("Cell In[4], line 3\n      1 t = torch.ones(1)\n      2 if rank == 1:\n"
      "----> 3     raise ValueError('bad')\n")


def test_raise_before_collective_names_culprit_and_waiter():
    res = _res(r0=dict(status="error", ename="RuntimeError", collective=True,
                       evalue="[gloo] Timed out waiting 6000ms for recv"),
               r1=dict(status="error", ename="ValueError", evalue="bad", traceback=TB),
               r2=dict(status="ok"))
    d = classify(res)
    assert d.culprits == [1] and d.waiting == [0] and d.needs_reform
    err = remote_error(res, d, timeout_s=6, reform_msg="The process group was re-formed", reformed=True)
    assert err.summary.startswith("rank 1 raised ValueError; rank 0 waiting on rank 1")
    assert "(process group re-formed, state kept)" in err.summary
    assert "at cell line 3: raise ValueError('bad')" in err.report
    assert err.waiting == [0] and err.reformed
    assert first_error(res) == "rank 0: error: RuntimeError: [gloo] Timed out waiting 6000ms for recv"


def test_a_group_left_unformed_is_not_summarised_as_re_formed():
    """The summary reads the re-form's flag, not a word in its message: "was not
    re-formed yet" (a rank still busy) must not read "(process group re-formed)"."""
    res = _res(r0=dict(status="error", ename="RuntimeError", collective=True,
                       evalue="[gloo] Timed out waiting 6000ms for recv"),
               r1=dict(status="error", ename="ValueError", evalue="bad", traceback=TB))
    d = classify(res)
    msg = "rank 1 still busy, so the process group was not re-formed yet: wait and run %dp reform."
    err = remote_error(res, d, timeout_s=6, reform_msg=msg, reformed=False)
    assert "re-formed, state kept" not in err.summary and msg in err.report
    assert not err.reformed


def test_collective_error_without_a_culprit_is_not_waiting():
    res = _res(r0=dict(status="error", ename="DistBackendError", evalue="x", collective=True),
               r1=dict(status="ok"))
    d = classify(res)
    assert d.culprits == [] and d.waiting == [] and d.needs_reform


def test_death_and_timeout_are_culprits():
    res = _res(r0=dict(status="died", died="killed by signal 9 (SIGKILL)"),
               r1=dict(status="timeout"), r2=dict(status="interrupted"))
    d = classify(res)
    assert d.died == {0: "killed by signal 9 (SIGKILL)"} and d.timed_out == [1]
    assert d.culprits == [0, 1] and d.interrupted == [2]
    err = remote_error(res, d, timeout_s=30, reform_msg="", reformed=False)
    assert "rank 0 died: killed by signal 9" in err.report
    # no cell timeout in this result: the sentence says why rank 1 was stopped instead
    assert "rank 1 was still running after" in err.report and "cell timeout" not in err.report
    timed = remote_error(dataclasses.replace(res, cell_timeout_s=5.0), d, timeout_s=30,
                         reform_msg="", reformed=False)
    assert "rank 1 did not finish within the cell's 5 s timeout" in timed.report
    assert "rank 2 interrupted (Ctrl-C)" in err.report


def test_same_user_error_on_every_rank_is_one_line():
    same = dict(status="error", ename="TrainError", evalue="no dataset chosen: run %dp data")
    assert str(plain_user_error(_res(r0=same, r1=same))) == "no dataset chosen: run %dp data"
    other = dict(same, evalue="something else")
    assert plain_user_error(_res(r0=same, r1=other)) is None
    assert plain_user_error(_res(r0=same, r1=dict(status="ok"))) is None


def test_setup_log_is_bounded_and_describes_what_it_replays():
    log = SetupRecord(limit=3)
    log.add(SetupCell("import torch\nnet = torch.nn.Linear(2, 2)\n"))
    log.add(WrapStep("net", "ddp", {"lr": 0.1}))
    assert log.describe() == ["1. cell: import torch (+1 lines)", "2. wrap net (ddp)"]
    assert log.wrapped
    log.add(DataStep("ds"))
    log.add(DataStep("ds2"))
    assert len(log) == 3 and log.dropped == 1
    assert log.describe()[0].startswith("(1 older entries were dropped")
    log.clear()
    assert len(log) == 0 and log.describe() == []


def test_nccl_two_ranks_on_one_gpu_is_refused_before_any_process_starts():
    from dpnb.cluster.launch import check_start_args

    with pytest.raises(DpnbError, match="puts two ranks on cuda:0: NCCL refuses two ranks on one"):
        check_start_args(2, "nccl", "local", 30.0, None, "0,0")
    assert check_start_args(2, "gloo", "local", 30.0, None, "0,0") == [0, 0]


def test_mismatch_names_each_ranks_op_shape_dtype_and_line():
    from dpnb.engine.cell.collcheck import CollectiveMismatchError

    table = {0: {"call": "all_reduce [4] float32", "at": "cell line 2", "check": 1},
             1: {"call": "all_reduce [5] float32", "at": "cell line 2", "check": 1}}
    msg = str(CollectiveMismatchError("all_reduce", table))
    tb = "Cell In[3], line 2\n      1 t = torch.ones(4 + rank)\n----> 2 dist.all_reduce(t)\n"
    res = _res(r0=dict(status="error", ename="CollectiveMismatchError", evalue=msg, traceback=tb),
               r1=dict(status="error", ename="CollectiveMismatchError", evalue=msg, traceback=tb))
    d = classify(res)
    # no collective ran: the group is as good as before, nothing to re-form
    assert d.mismatch == [0, 1] and d.culprits == [0, 1] and not d.needs_reform
    err = remote_error(res, d, timeout_s=30, reform_msg="", reformed=False)
    assert "rank 0: all_reduce [4] float32 at cell line 2" in err.report
    assert "rank 1: all_reduce [5] float32 at cell line 2" in err.report
    assert err.report.count("rank 1: all_reduce [5]") == 1  # the table is shown once
    assert err.summary == "ranks 0-1 called different collectives"


def test_where_verdict_names_the_blocked_rank_and_the_one_that_never_came():
    from dpnb.cluster.diagnose import where_verdict

    res = _res(r0=dict(status="ok"), r1=dict(status="timeout"))
    res.where = {
        0: {"running": False, "cell_calls": {}, "collective": None},
        1: {"running": True, "cell_line": 3, "cell_calls": {"all_reduce": 1},
            "collective": {"op": "all_reduce", "seq": 1, "shape": [3], "dtype": "float32"}},
    }
    assert where_verdict(res) == ("rank 1 is blocked in all_reduce #1 (shape [3], float32) at "
                                  "cell line 3; rank 0 finished the cell without entering it")
    res.where[0] = {"running": True, "cell_line": 4, "top": "sleep (x.py:1)", "collective": None}
    assert "rank 0 is running sleep (x.py:1) at cell line 4" in where_verdict(res)


def test_a_release_always_means_re_forming():
    res = _res(r0=dict(status="error", ename="ValueError", evalue="x"), r1=dict(status="ok"))
    assert not classify(res).needs_reform
    res.released = True
    assert classify(res).needs_reform


def test_preload_is_skipped_when_engines_outnumber_cores(monkeypatch):
    from dpnb.cluster.launchers.local import preload_setting
    from dpnb.engine.proc import preload as setup

    # the launcher's rule: engines <= cores preload everything, more engines torch only
    assert [preload_setting(n, 2) for n in (1, 2, 3, 32)] == ["all", "all", "torch", "torch"]
    assert preload_setting(16, 16) == "all"
    # ... and what an engine makes of it
    monkeypatch.setenv(setup.PRELOAD_ENV, "torch")
    assert setup.preload_modules() == ()
    monkeypatch.setenv(setup.PRELOAD_ENV, "all")
    assert "torch._dynamo" in setup.preload_modules()


def test_slurm_nodes_and_options_reach_the_job_script():
    # ipyparallel keeps an `options` setting but writes nothing of it
    import types

    from traitlets.config import Config

    from dpnb.cluster.launchers.slurm_mpi import apply_slurm_args

    ic = types.SimpleNamespace(config=Config())
    apply_slurm_args(ic, ["nodes=2", "options=--ntasks-per-node=2 --gres={gpu}:1",
                                      "queue=debug"])
    tpl = ic.config.SlurmEngineSetLauncher.batch_template
    text = tpl.format(cluster_id="c1", program_and_args="ipengine", output_file="/p/e.out")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --gres={gpu}:1\n" in text
    # the job's output goes where ipyparallel says (the profile), not into the cwd
    assert "#SBATCH --output=/p/e.out\n" in text
    assert text.endswith("srun ipengine\n") and "--job-name=ipengine-c1" in text
    assert ic.config.SlurmEngineSetLauncher.queue == "debug"
