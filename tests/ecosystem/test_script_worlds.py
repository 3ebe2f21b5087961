"""``%dp run`` as torchrun's fresh processes would have it: each script imports its
own siblings, its failure is reported from its own frames, and
``init_process_group`` refuses what torch refuses and honours its timeout."""

from __future__ import annotations

import time

import pytest
from helpers.ecosystem import assert_whole, script, torchrun

from dpnb.engine.group.lifecycle import AS_TORCHRUN
from dpnb.errors import DpnbError, RemoteCellError

#: a torchrun script of about 3 kB, as the issue's was: its report must not carry it
PADDING = "".join(f"# step {i}: nothing here but the size of a real script's comments\n"
                  for i in range(48))


def _two_scripts(tmp_path):
    for name, body in (("a", "def f():\n    return 'a'\n"),
                       ("b", "def f():\n    x = 1\n    raise ValueError(f'b helper {x}')\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "helpers.py").write_text(f"WHO = {name!r}\n" + body)
        (tmp_path / name / "main.py").write_text(
            "import helpers\n" + PADDING
            + "print('helpers from', helpers.WHO, flush=True)\nhelpers.f()\n")
    return str(tmp_path / "a" / "main.py"), str(tmp_path / "b" / "main.py")


def test_a_second_script_imports_its_own_sibling_and_is_reported_from_its_frames(c, tmp_path):
    pids = [r.pid for r in c.ranks]
    a, b = _two_scripts(tmp_path)
    c.run("import sys\n_before = (list(sys.path), list(sys.argv))", display=False)
    assert "helpers from a" in c.run_script(a, display=False).outcomes[0].stdout
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(b, display=False)  # a's helpers.py was cached: b must get its own
    assert "helpers from b" in c.last_failure.outcomes[0].stdout
    report, source = ei.value.report, open(b).read()
    assert len(source) > 3000
    # at b's helper, by its path; the script's frames first; no dpnb exec line, no source
    assert f"at {tmp_path}/b/helpers.py line 4: raise ValueError(f'b helper {{x}}')" in report
    frames = [ln.strip() for ln in report.splitlines() if ln.strip().startswith("File ")]
    assert frames[0].startswith(f"File {b}:"), report
    assert "dpnb.engine.cell.script" not in report and "__import__" not in report, report
    assert len(report) < 1500, report  # a normal traceback's size, not the script's
    # the first script again: its own sibling, fresh; the rank's modules given back
    assert "helpers from a" in c.run_script(a, display=False).outcomes[0].stdout
    r = c.run("_after = ('helpers' in sys.modules, (list(sys.path), list(sys.argv)) == _before,"
              " sys.modules['__main__'].__name__)", display=False)
    assert r.ok and c.pull("_after") == [(False, True, "__main__")] * 2
    assert_whole(c, pids)


def test_device_id_cpu_is_refused_as_torchrun_refuses_it(c, tmp_path):
    ref = torchrun("init_args.py", "--device-id", "cpu", cwd=tmp_path, fails=True)
    torch_says = "ValueError: init_process_group device_id parameter must be an accelerator"
    assert torch_says in ref
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(script("init_args.py"), ["--device-id", "cpu"], display=False)
    assert ei.value.summary.startswith("ranks 0-1 raised ValueError"), ei.value.summary
    assert torch_says in ei.value.report and AS_TORCHRUN in ei.value.report
    assert c.run("_next = rank", display=False).ok  # nothing was formed or broken


def test_backend_options_are_refused_in_one_line(c):
    with pytest.raises(DpnbError) as ei:
        c.run_script(script("init_args.py"), ["--pg-options"], display=False)
    assert "pg_options (a formed group's backend options cannot change" in str(ei.value)
    assert "\n" not in str(ei.value)


def test_the_scripts_timeout_holds_for_its_run_and_the_clusters_after(c):
    res = c.run_script(script("init_args.py"), ["--timeout", "7", "--show-timeout"],
                       display=False)
    assert "rank 1 group timeout 7\n" in res.outcomes[1].stdout
    assert "its timeout (7 s) holds until this cell or run ends" in res.outcomes[1].stderr
    r = c.run("_t = dist.distributed_c10d._get_default_group()._get_backend("
              "torch.device('cpu')).options._timeout.total_seconds()", display=False)
    assert r.ok and c.pull("_t") == [c.timeout_s] * 2
    # a 2 s timeout: rank 1 gives up waiting for a rank 0 busy for 20 s, as under
    # torchrun (with the cluster's default, torch's 30 min, it would wait and succeed)
    t0 = time.monotonic()
    with pytest.raises(RemoteCellError) as ei:
        c.run_script(script("init_args.py"), ["--timeout", "2", "--rank0-busy", "20"],
                     display=False)
    assert time.monotonic() - t0 < 20  # failed at the script's timeout, not after the wait
    err = c.last_failure.outcomes[1]
    assert "Timed out after 2 s" in err.evalue, (err.evalue, ei.value.report)
