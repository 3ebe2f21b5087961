"""``%dp`` / ``%%dp`` driven through a real IPython InteractiveShell."""

import psutil
import pytest
from IPython.core.error import UsageError

import dpnb


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _usage(ip, line, cell=None):
    with pytest.raises(UsageError) as ei:
        if cell is None:
            ip.run_line_magic("dp", line)
        else:
            ip.run_cell_magic("dp", line, cell)
    msg = str(ei.value)
    assert "\n" not in msg.strip(), "bad input must give a one-line error"
    return msg


def test_help_is_real(ip):
    doc = ip.find_line_magic("dp").__doc__
    for needle in ("%dp start", "-n N", "--backend {auto,gloo,nccl}", "--engines",
                   "--gpus", "--timeout", "%%dp [--ranks SPEC]", "--rank RANK"):
        assert needle in doc, needle


def test_wrong_state_and_bad_input_before_start(ip):
    assert "start one with %dp start" in _usage(ip, "", "print(rank)")
    assert "start one with %dp start" in _usage(ip, "status")
    assert "start one with %dp start" in _usage(ip, "pull x")
    assert "unknown %dp subcommand 'bogus'" in _usage(ip, "bogus")
    assert "-n must be a whole number of engines >= 1" in _usage(ip, "start -n 0")
    assert "invalid choice: 'mpich'" in _usage(ip, "start --backend mpich")
    assert "invalid choice: 'pbs'" in _usage(ip, "start --engines pbs")
    assert "argument -n: invalid int value" in _usage(ip, "start -n two")
    msg = _usage(ip, "start -n 2 --backend nccl")
    assert "needs 2 GPUs but this host has 0" in msg and "--backend gloo" in msg
    assert dpnb.get_cluster(ip) is None  # nothing was started by the failures


def test_start_cells_push_pull_stop(ip, capsys):
    from dpnb.magics import get_magics

    m = get_magics(ip)
    m.prewarm()  # as %load_ext did (or an earlier %dp stop, in this shared shell)
    warm_pid = m.warm.pid
    ip.run_line_magic("dp", "start -n 2 --timeout 6")
    c = dpnb.get_cluster(ip)
    assert c is not None and c.world_size == 2
    # the engines were forked by an agent forked from the template started ahead
    agents = {psutil.Process(r.pid).ppid() for r in c.ranks}
    assert {psutil.Process(a).ppid() for a in agents} == {warm_pid} and m.warm.pid == warm_pid
    assert "2 ranks up (gloo" in capsys.readouterr().out

    ip.run_cell_magic("dp", "", "print(rank, world_size)")
    assert capsys.readouterr().out == "[rank 0]\n0 2\n[rank 1]\n1 2\n"
    ip.run_cell_magic("dp", "", "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint(t)")
    assert capsys.readouterr().out == "[all 2 ranks]\ntensor([3.])\n"
    ip.run_cell_magic("dp", "--ranks 1:", "print('only', rank)")
    assert capsys.readouterr().out == "[rank 1]\nonly 1\n"

    ip.user_ns["lr"] = 0.25
    ip.run_line_magic("dp", "push lr")
    assert ip.run_line_magic("dp", "pull lr") == [0.25, 0.25]
    assert ip.run_line_magic("dp", "pull rank --rank 1") == 1

    assert "already running (2 ranks" in _usage(ip, "start -n 2")
    assert "out of range" in _usage(ip, "--ranks 4", "print(1)")
    assert "bad rank selection" in _usage(ip, "--ranks zero", "print(1)")
    assert "not defined on ranks 0-1" in _usage(ip, "pull missing_name")
    assert "not defined in the notebook: nope" in _usage(ip, "push nope")

    # an error in a cell is a report (no dpnb-internal traceback) and the
    # cluster keeps working
    r = ip.run_cell("%%dp\nif rank == 0:\n    raise KeyError('k')\n")
    assert type(r.error_in_exec).__name__ == "RemoteCellError"
    assert "rank 0 raised KeyError" in r.error_in_exec.report
    ip.run_line_magic("dp", "status")
    out = capsys.readouterr().out
    assert "rank" in out and "alive" in out and str(c.ranks[0].pid) in out
    assert ip.run_line_magic("dp", "pull lr") == [0.25, 0.25]

    ip.run_line_magic("dp", "stop")
    assert "cluster stopped" in capsys.readouterr().out
    assert not c.running
    # the template outlives the cluster, for the next start; unloading ends it
    assert m.warm.pid == warm_pid and psutil.pid_exists(warm_pid)
    dpnb.unload_ipython_extension(ip)
    assert m.warm is None and not _running(warm_pid)
    assert "start one with %dp start" in _usage(ip, "", "print(1)")
