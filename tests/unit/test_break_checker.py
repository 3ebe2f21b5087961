"""The deliberate-break checker is itself checked: it says "caught" only when a
named test really failed, and never for a test that does not exist, skips, or
cannot be collected.

Each case builds a small project (a module, this suite's own ``conftest.py``
that writes the outcomes, a test file) and runs ``tests/helpers/breakrun.py``
on it, as ``tests/break_on_purpose.py`` does on dpnb.
"""

import os
import shutil
import textwrap

import pytest

from helpers import breakrun

HERE = os.path.dirname(os.path.abspath(__file__))

MOD = "def double(x):\n    return 2 * x\n"
TESTS = '''
import os
import pytest
from pkg.mod import double

def test_double():
    assert double(2) == 4

def test_vacuous():
    assert double(2) is not None

def test_skips():
    pytest.skip("nothing to see here")
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    # only pytest itself in the small project's runs: a second each, not six
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MOD)
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(os.path.join(HERE, "..", "conftest.py"), tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "unit" / "test_a.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "--import-mode=importlib"\npythonpath = ["."]\n')
    return str(tmp_path)


def _entry(tests, old="return 2 * x", new="return 3 * x", name="double doubles"):
    return breakrun.Entry(name, "pkg/mod.py", old, new, tuple(tests))


def _judge(root, entry, zygote=None):
    ids_of, bad = breakrun.validate([entry], None, root)
    if bad:
        return bad[0]
    return breakrun.try_break(entry, ids_of[entry.name], root, zygote)


def test_a_break_judged_in_a_zygote_reads_as_in_a_fresh_pytest(project):
    """The runner forks each break's pytest from a preloaded interpreter
    (tests/helpers/zygote.py): caught, missed and a collection error read as
    they do from a pytest started anew, and each fork sees the file broken
    (the zygote itself never imported it)."""
    from helpers.zygote import Zygote

    z = Zygote(project, breakrun._env(project))
    try:
        cases = [(_entry(["tests/unit/test_a.py::test_double"]), "caught"),
                 (_entry(["tests/unit/test_a.py::test_vacuous"]), "MISSED"),
                 (_entry(["tests/unit/test_a.py::test_double"], "def double(x)",
                         "def doubled(x)"), "INVALID"),
                 (_entry(["tests/unit/test_a.py::test_double"]), "caught")]
        for entry, word in cases:
            v = _judge(project, entry, z)
            assert v.word == word, v.line()
        assert z.proc.poll() is None  # one zygote served them all
    finally:
        z.close()
    with open(os.path.join(project, "pkg", "mod.py")) as fh:
        assert fh.read() == MOD


def test_a_break_is_caught_when_a_named_test_fails(project):
    v = _judge(project, _entry(["tests/unit/test_a.py::test_double"]))
    assert v.word == "caught", v.line()
    with open(os.path.join(project, "pkg", "mod.py")) as fh:
        assert fh.read() == MOD  # restored


def test_a_break_its_tests_pass_is_missed(project):
    v = _judge(project, _entry(["tests/unit/test_a.py::test_vacuous"]))
    assert v.word == "MISSED", v.line()


def test_a_renamed_test_makes_the_entry_invalid_not_caught(project):
    # the old checker read any non-zero exit as caught: pytest exits 4 here
    v = _judge(project, _entry(["tests/unit/test_a.py::test_double_renamed"]))
    assert v.word == "INVALID" and "test_double_renamed" in v.detail, v.line()


def test_a_named_test_that_skips_makes_the_entry_invalid(project):
    v = _judge(project, _entry(["tests/unit/test_a.py::test_skips"]))
    assert v.word == "INVALID" and "does not pass unbroken" in v.detail, v.line()


def test_a_break_that_stops_collection_is_invalid_not_caught(project):
    # pytest exits 4 (the named module did not import): no named test ran
    v = _judge(project, _entry(["tests/unit/test_a.py::test_double"], "def double(x)",
                               "def doubled(x)"))
    assert v.word == "INVALID" and "collection or usage error" in v.detail, v.line()


def test_one_failing_named_test_among_several_is_enough_and_all_of_them_run(project):
    v = _judge(project, _entry(["tests/unit/test_a.py::test_vacuous",
                                "tests/unit/test_a.py::test_double"]))
    assert v.word == "caught" and "1 of 2 named tests failed" in v.detail, v.line()


def test_the_share_slices_hold_every_entry_once_and_keep_it_when_the_list_grows():
    es = [_entry([f"t{i}"], name=f"entry {i}") for i in range(60)]
    slices = [breakrun.share(es, k, 5) for k in range(7, 12)]  # any 5 consecutive
    assert sorted(id(e) for s in slices for e in s) == sorted(id(e) for e in es)
    assert min(map(len, slices)) >= 5  # no slice empty or starved
    # an entry added at the front moves no other entry to another slice
    grown = [_entry(["t-new"], name="a new entry")] + es
    assert {e.name: k for k in range(5) for e in breakrun.share(grown, k, 5) if e in es} == \
        {e.name: k for k in range(5) for e in breakrun.share(es, k, 5)}


def test_every_entry_of_the_list_applies_once_and_names_existing_files():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "break_on_purpose", os.path.join(HERE, "..", "break_on_purpose.py"))
    bop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bop)
    es = breakrun.entries(bop.MUTATIONS)
    assert len(es) > 200 and len({e.name for e in es}) == len(es)
    for e in es:
        with open(os.path.join(breakrun.ROOT, e.file)) as fh:
            assert fh.read().count(e.old) == 1, e.name
        for t in e.tests:
            assert os.path.isfile(os.path.join(breakrun.ROOT, t.split("::")[0])), (e.name, t)


def test_a_required_tier_that_skipped_fails_ci_naming_the_tier_and_why():
    import require_tiers

    recs = [{"nodeid": "tests/hosted/test_hub.py::test_a", "when": "setup", "outcome": "skipped",
             "reason": "configurable-http-proxy not found"},
            {"nodeid": "tests/browser/test_lab.py::test_b", "when": "call", "outcome": "passed"},
            {"nodeid": "tests/gpu/test_g.py::test_c", "when": "setup", "outcome": "skipped",
             "reason": "no GPU"}]
    bad = require_tiers.problems(recs, ["hosted", "browser", "shared"])
    assert bad == ["tier hosted must run here, but tests/hosted/test_hub.py::test_a skipped: "
                   "configurable-http-proxy not found",
                   "tier shared must run here, but none of its tests ran"]
    assert require_tiers.problems(recs, ["browser"]) == []  # gpu's skip is not asked about


def test_the_rotation_ledger_runs_every_slice_in_any_n_consecutive_landings(tmp_path, monkeypatch):
    """CI's ledger: each landing (a new commit) takes the slice after the last one run,
    a re-run of the same commit takes the same slice again, a slice with an entry
    not caught does not advance it, and a fresh machine starts from the commit count."""
    ledger, n = str(tmp_path / "rotation.json"), 5
    commit = {"sha": "c0", "count": 17}
    monkeypatch.setattr(breakrun, "head", lambda root=breakrun.ROOT: commit["sha"])
    monkeypatch.setattr(breakrun, "commit_count", lambda root=breakrun.ROOT: commit["count"])
    assert breakrun.ledger_slice(ledger, n) == 17 % n  # no ledger yet
    ran = []
    for landing in range(12):
        commit.update(sha=f"c{landing}", count=17 + 3 * landing)  # landings bring several commits
        k = breakrun.ledger_slice(ledger, n)
        assert breakrun.ledger_slice(ledger, n) == k  # asking again changes nothing
        ran.append(k)
        breakrun.ledger_advance(ledger, k, n)
        assert breakrun.ledger_slice(ledger, n) == k  # a re-run of this commit: the same slice
    for i in range(len(ran) - n + 1):
        assert set(ran[i:i + n]) == set(range(n)), ran
    commit.update(sha="c-red")  # this landing's slice missed an entry: not advanced
    k = breakrun.ledger_slice(ledger, n)
    commit.update(sha="c-fixed")
    assert breakrun.ledger_slice(ledger, n) == k


def test_a_break_runs_without_the_plugins_its_tests_never_use(project):
    """hypothesis's pytest plugin alone cost 0.8 s of a unit break's 1.9 s: a break's
    pytest loads only the plugins its named tests' files mention."""
    with open(os.path.join(project, "tests", "unit", "test_prop.py"), "w") as f:
        f.write("from hypothesis import given\n")
    assert breakrun.lean(["tests/unit/test_a.py::test_double"], project) == [
        "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:xdist"]
    assert breakrun.lean(["tests/unit/test_prop.py"], project) == [
        "-p", "no:anyio", "-p", "no:xdist"]
    assert breakrun.lean(["tests/unit/missing.py::t"], project) == []  # unknown: every plugin


LEAKS = '''
import os
import subprocess
import sys
from pkg.mod import double

def test_double_and_leave_a_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                         start_new_session=True)
    with open(os.environ["LEAK_FILE"], "w") as f:
        f.write(str(p.pid))
    assert double(2) == 4
'''


def test_what_a_broken_run_left_running_is_stopped_and_nothing_else(project, tmp_path,
                                                                     monkeypatch):
    """A break that removes a cleanup leaves what the cleanup would stop (CI found
    a controller and its 8 schedulers after a rehearsal): the runner stops the
    processes its run started -- marked in their environment -- and no other."""
    import subprocess
    import sys
    import time

    import psutil

    leak = tmp_path / "leak.pid"
    monkeypatch.setenv("LEAK_FILE", str(leak))
    with open(os.path.join(project, "tests", "unit", "test_leak.py"), "w") as f:
        f.write(LEAKS)
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        v = _judge(project, _entry(["tests/unit/test_leak.py::test_double_and_leave_a_process"]))
        assert v.word == "caught", v.line()
        left = int(leak.read_text())
        for _ in range(50):
            if not psutil.pid_exists(left) or psutil.Process(left).status() == "zombie":
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the broken run's process {left} is still running")
        assert mine.poll() is None  # not the run's: left alone
    finally:
        mine.kill()
        mine.wait()
