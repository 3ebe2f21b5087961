"""torchrun scripts as people write them, run by ``%dp run`` and pasted into cells:
the same numbers as under torchrun, and the cluster whole afterwards."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers.ecosystem import assert_whole, numbers, script, torchrun

from dpnb.cluster.diagnose import cell_notes
from dpnb.errors import RemoteCellError


def _source(name: str) -> str:
    with open(script(name)) as f:
        return f.read()


def test_a_ddp_script_runs_by_dp_run_as_under_torchrun(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    ref = torchrun("ddp_train.py", "--epochs", "2", "--checkpoint", "ref.pt", cwd=tmp_path)
    ck = str(tmp_path / "dpnb.pt")
    res = c.run_script(script("ddp_train.py"), ["--epochs", "2", "--checkpoint", ck],
                       display=False)
    got = res.outcomes[0].stdout
    assert "world size 2, local rank 0" in got
    want = numbers(ref, "loss")
    assert len(want) == 2 and numbers(got, "loss") == pytest.approx(want, rel=1e-5)
    # init_process_group joined the running group; destroy_process_group left it up
    assert "init_process_group() joined the cluster's running gloo group" in res.outcomes[1].stderr
    assert "destroy_process_group() left the cluster's group up" in res.outcomes[1].stderr
    a = torch.load(ck)["model"]
    b = torch.load(tmp_path / "ref.pt")["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # the script's module globals are in every rank's namespace; __main__ is restored
    r = c.run("_g = (callable(main), callable(parse_args), __name__)", display=False)
    assert r.ok and c.pull("_g") == [(True, True, "__main__")] * 2
    assert_whole(c, pids)


def test_the_same_script_pasted_into_a_cell(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    ref = torchrun("ddp_train.py", "--epochs", "1", cwd=tmp_path)
    src = _source("ddp_train.py").replace('default=2)', 'default=1)', 1)
    res = c.run(src, display=False)  # argparse sees an empty command line on the engines
    assert numbers(res.outcomes[0].stdout, "loss") == pytest.approx(numbers(ref, "loss"),
                                                                     rel=1e-5)
    assert_whole(c, pids)


def test_a_refused_init_process_group_is_reported_at_the_scripts_line(c):
    """torch refuses ``device_id=cpu`` under torchrun; so does the cell, and the
    report ends at the script's own call, with no frame of dpnb's (issue 58)."""
    pids = [r.pid for r in c.ranks]
    call = 'dist.init_process_group(backend="gloo", device_id=torch.device("cpu"))'
    src = _source("ddp_train.py").replace('dist.init_process_group(backend="gloo")', call, 1)
    with pytest.raises(RemoteCellError) as ei:
        c.run(src, display=False)
    report = ei.value.report
    assert "ValueError: init_process_group device_id parameter must be an accelerator" in report
    assert f"---> 42     {call}" in report, report
    assert "dpnb/" not in report and "lifecycle.py" not in report, report
    assert_whole(c, pids)


def test_an_fsdp2_script_with_a_distributed_checkpoint(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    ref = torchrun("fsdp_train.py", "--steps", "3", cwd=tmp_path)
    ck = str(tmp_path / "ckpt")
    res = c.run_script(script("fsdp_train.py"), ["--steps", "3", "--checkpoint-dir", ck],
                       display=False)
    assert numbers(res.outcomes[0].stdout, "loss") == pytest.approx(numbers(ref, "loss"),
                                                                     rel=1e-5)
    assert sorted(os.listdir(ck)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # FSDP's own all-gathers, identical on every rank: no note that cries wolf (issue 58)
    assert cell_notes(res) == [], cell_notes(res)
    assert_whole(c, pids)


def test_bad_arguments_show_the_scripts_usage_and_cost_nothing(c):
    pids = [r.pid for r in c.ranks]
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(script("ddp_train.py"), ["--epochs", "two"], display=False)
    assert time.monotonic() - t0 < 5
    e = ei.value
    assert e.summary == "ranks 0-1 exited the script"
    assert "ranks 0-1: ddp_train.py exited with status 2" in e.report
    err = c.last_failure.outcomes[0].stderr
    assert err.startswith("usage: ddp_train.py") and "invalid int value: 'two'" in err
    assert_whole(c, pids)


def test_a_failing_script_is_reported_at_its_own_line_and_debugged_post_mortem(c, tmp_path,
                                                                              capsys):
    pids = [r.pid for r in c.ranks]
    path = tmp_path / "fails.py"
    path.write_text("import torch.distributed as dist\n\n\ndef main():\n"
                    "    dist.init_process_group('gloo')\n    scale = 3 + dist.get_rank()\n"
                    "    raise ValueError(f'bad scale {scale}')\n\n\nif __name__ == '__main__':\n"
                    "    main()\n")
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(str(path), display=False)
    assert f"at {path} line 7: raise ValueError(f'bad scale {{scale}}')" in ei.value.report
    # %dp debug: pdb on rank 1's traceback, at the raising frame, commands from a list
    capsys.readouterr()
    assert c.debug(1, commands=["p scale * 10", "up", "p sorted(globals())[:1]"]) == ""
    out = capsys.readouterr().out
    assert "(Pdb rank 1) p scale * 10\n40" in out and "fails.py(7)main()" in out, out
    assert_whole(c, pids)


def test_run_inside_a_cell_raises_the_scripts_error(c, tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("print('in the script')\nraise KeyError('boom')\n")
    with pytest.raises(RemoteCellError) as ei:
        c.run(f"%run {path}", display=False)
    assert ei.value.summary.startswith("ranks 0-1 raised KeyError")
    assert f"at {path} line 2: raise KeyError('boom')" in ei.value.report


def test_where_names_the_line_of_a_running_script(c, tmp_path):
    path = tmp_path / "slow.py"
    path.write_text("import time\n\n\ndef work():\n    time.sleep(30)\n\n\nwork()\n")
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(str(path), timeout=1.5, display=False)
    assert time.monotonic() - t0 < 10
    assert f"rank 0 is running Python code at {path} line 5" in ei.value.report, ei.value.report
