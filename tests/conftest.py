"""Test-wide settings and the one layout rule: a test's folder is its tier.

``unit/`` (fast, one machine, no engine and no cluster: pure logic, plus short
Python subprocesses, world-size-1 gloo groups, and local sockets and threads
where the thing tested is one -- the wire's servers, the import checks), ``cluster/``
(real ipyparallel engines or multi-process gloo groups), ``ecosystem/`` (code
written the way other projects write it -- torchrun scripts, DDP/FSDP/ZeRO
built in cells, Accelerate -- on real clusters), ``multihost/``
(two hosts from network namespaces: ssh, Slurm, Open MPI), ``shared/`` (a
second unix user and a third namespace host attack a running cluster; root
only), ``notebook/``
(nbclient), ``browser/`` (JupyterLab in Chromium), ``slow/`` (fresh virtual
environments, the benchmark smoke run), ``standin/`` (dpnb's engine code on
multi-process groups whose backend, like NCCL, serves the CUDA device type
only: a CPU tensor at a collective fails as under NCCL; see
``helpers/standin.py``), ``gpu/`` (one CUDA GPU; skipped
without one).  Each test gets its folder's marker here, so
``-m "not cluster and not ecosystem and not multihost and not shared and not notebook and not browser and not slow and not gpu and not standin"``
selects the fast tier (the same tests as ``tests/unit``).  Shared helpers are the package ``tests/helpers``.

IPython/Jupyter state is kept out of the user's home.
"""

import json
import os
import pathlib
import shutil
import signal
import tempfile

import pytest

# Under pytest-xdist (`-n 2`) each worker gets its own temporary folder, with
# /tmp's mode (sticky, world-writable: tests/shared plants files there as a
# second user would in /tmp): the tests that check a start left no
# "dpnb-profile-*" folder behind, and dpnb's private folder, look in their
# own worker's, not at the other worker's clusters.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    tempfile.tempdir = tempfile.mkdtemp(prefix=f"dpnb-tests-{_worker}-")
    os.chmod(tempfile.tempdir, 0o1777)
    os.environ["TMPDIR"] = tempfile.tempdir
_home = tempfile.mkdtemp(prefix="dpnb-test-home-")
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                 ("JUPYTER_DATA_DIR", "jupyter-data"), ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                 ("MPLCONFIGDIR", "mpl")):
    os.environ[var] = os.path.join(_home, sub)
    os.makedirs(os.environ[var], exist_ok=True)
# kept clusters' records, not in the user's ~/.local/state
os.environ["DPNB_STATE_DIR"] = os.path.join(_home, "kept")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests press Ctrl-C by sending SIGINT to this process, as Jupyter does to a
# kernel.  A run started in the background by a non-interactive shell
# (`.ci/run &`) inherits SIGINT ignored, and Python keeps it ignored: those
# tests then waited for an interrupt that never came (three failed that way
# here).  A kernel always handles SIGINT, so the tests run with Python's own
# handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under `pytest -n 2` (pytest-xdist) a test module is the unit of work -- its
# module-scoped cluster and its tests' order stay on one worker -- except the
# tiers that make network namespaces and unix users (names and subnets per
# process): those run one after another on one worker, never beside each other.
_TOGETHER = {"multihost": "namespaces", "shared": "namespaces"}
TESTS = pathlib.Path(__file__).resolve().parent
TIERS = ("unit", "cluster", "ecosystem", "multihost", "shared", "notebook", "browser", "slow",
         "standin", "gpu", "hosted")


def pytest_unconfigure(config):
    # The folder is this run's alone (mkdtemp); left behind, every run --
    # break_on_purpose.py runs pytest once per entry -- added one to /tmp
    # (1,237 of them here before this).
    # The shared IPython shell's history database lives in that folder: its exit
    # hook, run after this, wrote to the removed file ("attempt to write a readonly
    # database" at the end of every run that used magics).  It is closed now;
    # the hook skips a shell without one.
    from IPython.core.interactiveshell import InteractiveShell  # lazy: only at the end

    ip = InteractiveShell.instance() if InteractiveShell.initialized() else None
    if ip is not None and ip.history_manager is not None:
        ip.history_manager.end_session()
        ip.history_manager.close()
        ip.history_manager = None
    shutil.rmtree(tempfile.tempdir if _worker else _home, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) still loads this file
def pytest_xdist_make_scheduler(config, log):
    # xdist's own --dist loadgroup marks a group by suffixing the node id,
    # which pytest 9 no longer reads: the scopes are chosen here instead.
    from xdist.scheduler import LoadScopeScheduling  # lazy: only under -n

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _TOGETHER.get(_tier_of(nodeid), nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # keep the order set below
    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _item_tier(item)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    if _worker:
        # Long modules first, the unit tier's short ones last to fill the
        # gaps: the two workers then end together instead of one waiting on a
        # last fresh-venv install.  Both workers sort alike (xdist checks).
        items.sort(key=lambda it: _rank_of(it.nodeid))


#: set to 1 to give every in-process start its own torch import, as a plain
#: Python's ``dpnb.start`` has (the template below is then not started)
COLD_START_ENV = "DPNB_TEST_COLD_START"


@pytest.fixture(scope="session", autouse=True)
def _zygote_template(request):
    """One zygote template per test process, as each kernel has one.

    ``%load_ext dpnb`` starts a template that imported torch and forks every
    local start's agent (:mod:`dpnb.cluster.zygote`); the tests' in-process
    ``dpnb.start`` calls get the same, so a start's torch import is paid once
    per test process, not once per start.  Measured before it: 101 imports of
    3.9 CPU-s each in the cluster, ecosystem and notebook tiers, of 1,062
    CPU-s in all (`pytest -n 2`, 2 cores).  Started here, before any test,
    so the tests that compare this process's children before and after a
    start find it in both (not for a run of the unit tier alone: it starts no
    cluster).  A start passing ``warm=`` itself keeps its own;
    one the template cannot serve (an import-time variable changed) imports
    afresh, as in a kernel."""
    if os.environ.get(COLD_START_ENV) == "1" or all(
            _item_tier(it) in ("unit", "") for it in request.session.items):
        yield None
        return
    from dpnb.cluster import Engines, launch, zygote  # lazy: only where clusters start

    if not launch.prewarm_wanted():
        yield None
        return
    template = zygote.WarmZygote()
    plain = Engines.start_with.__func__

    def start_with(cls, o, warm=None):
        return plain(cls, o, warm=template if warm is None else warm)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engines, "start_with", classmethod(start_with))
        yield template
    template.close()


def _item_tier(item) -> str:
    """A collected test's tier: its folder under tests/ ("" outside tests/)."""
    try:
        return pathlib.Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
    except ValueError:
        return ""


#: tiers by how long a module of theirs runs, longest first (for -n only)
_LONG_FIRST = ("slow", "multihost", "shared", "hosted", "browser", "notebook", "cluster",
               "ecosystem", "standin", "gpu", "unit")


def _tier_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")  # "tests/<tier>/test_x.py"
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _rank_of(nodeid: str) -> int:
    tier = _tier_of(nodeid)
    return _LONG_FIRST.index(tier) if tier in _LONG_FIRST else len(_LONG_FIRST)


#: where every test's outcome is appended, one JSON line per phase, when the
#: variable is set: tests/break_on_purpose.py reads which named tests failed
#: (not pytest's exit code), and .ci/run reads which tiers skipped
OUTCOMES_ENV = "DPNB_TEST_OUTCOMES"


def pytest_runtest_logreport(report):
    path = os.environ.get(OUTCOMES_ENV)
    # Under xdist the controller is handed every worker's reports: it alone
    # writes, so each phase is one line.
    if not path or _worker:
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    elif report.failed:
        reason = (str(report.longrepr).strip().splitlines() or [""])[-1][:300]
    with open(path, "a") as fh:
        # (seconds, end time and worker: where CI's time goes, tests/README.md)
        fh.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                             "outcome": report.outcome, "reason": reason,
                             "seconds": round(report.duration, 2), "stop": round(report.stop, 1),
                             "worker": getattr(report, "node", None) and report.node.gateway.id
                             }) + "\n")
