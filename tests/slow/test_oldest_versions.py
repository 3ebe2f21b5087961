"""The oldest torch and ipyparallel pyproject.toml allows really run dpnb.

pyproject.toml declares ``torch>=X`` and ``ipyparallel>=Y``; only newer
versions are installed day to day.  This test reads X and Y from
pyproject.toml (so it follows the declared bounds), and in a fresh venv:

1. copies the repository as a clone would have it (no build outputs) and
   installs it editable from that copy with its dependencies, torch pinned
   to ``==X`` and ipyparallel to ``==Y`` by a constraints file (pip resolves
   everything else to what a fresh user gets), plus the test tools the unit
   tier needs (from the ``test`` extra) and the ``agent`` extra (the unit
   tier imports every module);
2. runs the unit tier (``tests/unit``) of the copy with that venv, less the
   break checker's and the import layers' files (they do not depend on either version);
3. runs ``tests/slow/oldest_smoke.py`` there: 2 ranks, an all_reduce, and
   ``c.wrap`` / ``c.train`` / ``c.check`` under ddp, zero1, zero2, zero3.

torch older than 2.13 has no CPU-only wheel on PyPI for x86_64, so X is the
CUDA build with its nvidia-* packages (about 3.5 GB; they import and run on a
machine without a GPU).  They are downloaded once into a folder kept across
runs (``$DPNB_WHEEL_CACHE``, default ``~/.cache/dpnb/oldest-wheels``; pip's own
cache keeps nothing here) and installed from it.  The venv itself is kept
too (``~/.cache/dpnb/oldest-venv/KEY``, KEY a hash of the Python version and
every requirement string installed; rebuilt from scratch once a week, and at
once when any of those strings changes): a kept one only takes this copy's
dpnb again (``pip install --no-deps -e``), which saves most of this test's
time (installing 3.5 GB of CUDA wheels).  The unit tier runs on two
workers.  Skipped only when the package index cannot be reached.

    python -m pytest tests/slow/test_oldest_versions.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from packaging.version import Version

from helpers import nbutil as nbu

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomli on 3.10")

pytestmark = pytest.mark.slow

PYPROJECT = nbu.REPO / "pyproject.toml"
SMOKE_STRATEGIES = "ddp,zero1,zero2,zero3"
#: what the unit tier needs beside dpnb's own dependencies, from the `test` extra (the
#: rest of it drives browsers, notebooks and other libraries' code: other tiers)
UNIT_TOOLS = ("pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "nbclient", "nbformat")
#: unit-tier files the oldest versions' run leaves to the outer run (see where they are left)
VERSIONLESS = ("test_break_checker.py", "test_layers.py")
#: the outer pytest's own variables: an inner pytest must not think it is an xdist worker
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JUPYTER_PATH", "JUPYTER_CONFIG_PATH",
               "PIP_REQUIRE_VIRTUALENV", "PIP_NO_CACHE_DIR", "PYTEST_ADDOPTS",
               "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
               "PYTEST_CURRENT_TEST", "DPNB_TEST_OUTCOMES")


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def lower_bound(requirements: list[str], name: str) -> str:
    """The X of ``name>=X`` among ``requirements`` (pyproject's strings)."""
    for req in requirements:
        if _name(req) == name:
            m = re.search(r">=\s*([0-9][^,;\s]*)", req)
            assert m, f"pyproject.toml gives {name} no lower bound (>=): {req!r}"
            return m.group(1)
    raise AssertionError(f"pyproject.toml does not depend on {name}")


def _index_url() -> str:
    """The index pip installs from here (its config, else PyPI)."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                           text=True, timeout=60)
        for line in p.stdout.splitlines():
            key, _, val = line.partition("=")
            if key.strip().endswith(".index-url") and not key.strip().endswith("extra-index-url"):
                url = val.strip().strip("'\"").split()[0]
    return (url or "https://pypi.org/simple").rstrip("/")


def _unreachable(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=15):
            return None
    except Exception as e:  # any failure to read the page: no index here
        return f"{type(e).__name__}: {e}"


def _run(cmd, *, env, cwd, timeout) -> subprocess.CompletedProcess:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _ok(p: subprocess.CompletedProcess, what: str) -> str:
    assert p.returncode == 0, (f"{what} failed ({p.returncode}):\n{p.stdout[-6000:]}\n"
                               f"{p.stderr[-6000:]}")
    return p.stdout


def _install_fresh(venv: Path, env: dict, tmp_path: Path, torch_v: str, pins: Path,
                   repo: Path, tools: list, agent: list) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = nbu.python_in(venv)
    # torch X and its CUDA libraries (about 3.5 GB) into a folder kept across runs:
    # pip's own cache keeps none of them here (the index's answers carry no cache
    # headers), so without it every CI run downloads them again
    wheels = Path(os.environ.get("DPNB_WHEEL_CACHE",
                                 Path.home() / ".cache" / "dpnb" / "oldest-wheels"))
    wheels.mkdir(parents=True, exist_ok=True)
    _ok(_run([py, "-m", "pip", "download", "-q", "-d", wheels, f"torch=={torch_v}"],
             env=env, cwd=tmp_path, timeout=2400), "pip download torch")
    _ok(_run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
              f"torch=={torch_v}"], env=env, cwd=tmp_path, timeout=2400), "pip install torch")
    # then dpnb with its own dependencies, as a user installs it
    _ok(_run([py, "-m", "pip", "install", "-q", "-c", pins, "-e", repo, *tools, *agent],
             env=env, cwd=tmp_path, timeout=2400), "pip install")


@pytest.mark.timeout(3600)
def test_the_oldest_declared_torch_and_ipyparallel_pass_the_unit_tier_and_a_2_rank_smoke(
        tmp_path):
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    deps = project["dependencies"]
    torch_v, ipp_v = lower_bound(deps, "torch"), lower_bound(deps, "ipyparallel")
    extras = project["optional-dependencies"]
    tools = [r for r in extras["test"] if _name(r) in UNIT_TOOLS]
    missing = set(UNIT_TOOLS) - {_name(r) for r in deps + tools}
    assert not missing, f"pyproject.toml declares none of {sorted(missing)}"
    agent = extras.get("agent", [])

    index = _index_url()
    why = _unreachable(f"{index}/torch/")
    if why:
        pytest.skip(f"the package index {index} cannot be reached ({why}): torch=={torch_v} "
                    f"and ipyparallel=={ipp_v} cannot be installed")

    t_all = time.monotonic()
    repo = nbu.copy_worktree(tmp_path / "repo")
    pins = tmp_path / "oldest.txt"
    pins.write_text(f"torch=={torch_v}\nipyparallel=={ipp_v}\n")
    kept = nbu.KeptVenv.of("oldest-venv", torch_v, ipp_v, sorted(deps), sorted(tools), sorted(agent))
    fresh = kept.fresh
    venv = kept.path  # built in place when fresh: a venv's scripts name their own path
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(nbu.jupyter_env(tmp_path / "home"), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
               DPNB_STATE_DIR=str(tmp_path / "home" / "kept"), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    if fresh:  # marked complete only once checked below: an interrupted build is redone
        _install_fresh(venv, env, tmp_path, torch_v, pins, repo, tools, agent)
    else:  # everything but this copy's dpnb is installed already
        _ok(_run([nbu.python_in(venv), "-m", "pip", "install", "-q", "--no-deps", "-e", repo],
                 env=env, cwd=tmp_path, timeout=600), "pip install dpnb")
    print(f"install ({'fresh venv' if fresh else 'kept venv ' + venv.name}): "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    py = nbu.python_in(venv)
    got = _ok(_run([py, "-c", "import importlib.metadata as m, dpnb; "
                    "print(m.version('torch'), m.version('ipyparallel'), dpnb.__file__)"],
                   env=env, cwd=tmp_path, timeout=300), "reading the installed versions").split()
    assert Version(Version(got[0]).public) == Version(torch_v), f"torch {got[0]}, not {torch_v}"
    assert Version(got[1]) == Version(ipp_v), f"ipyparallel {got[1]}, not {ipp_v}"
    assert Path(got[2]).resolve().is_relative_to(repo.resolve()), f"dpnb from {got[2]}, not the copy"
    if fresh:  # checked: the next run takes it as it is
        kept.done()

    # the whole unit tier, under the installed versions
    t0 = time.monotonic()
    # two workers, as the suite runs: this test's own worker waits meanwhile
    # less the two files that check the suite itself and dpnb's import graph (the break
    # checker, the layers): nothing there depends on torch's or ipyparallel's version,
    # and they are a third of the tier's time (the outer run has them)
    unit = _run([py, "-m", "pytest", "tests/unit", "-n", "2", "-p", "no:cacheprovider", "-q",
                 "--timeout", "120", "-rfE", *(f"--ignore=tests/unit/{f}" for f in VERSIONLESS)],
                env=env, cwd=repo, timeout=1800)
    unit_s = time.monotonic() - t0
    summary = (unit.stdout.strip().splitlines() or [""])[-1]
    print(f"unit tier ({unit_s:.0f} s): {summary}", flush=True)

    # 2 ranks: all_reduce, then wrap / train / check under each strategy
    t0 = time.monotonic()
    smoke = _run([py, repo / "tests" / "slow" / "oldest_smoke.py", "--strategies",
                  SMOKE_STRATEGIES], env=env, cwd=tmp_path, timeout=600)
    print(f"smoke ({time.monotonic() - t0:.0f} s):\n{smoke.stdout}", flush=True)
    print(f"torch {torch_v}, ipyparallel {ipp_v}: {time.monotonic() - t_all:.0f} s in all")

    problems = []
    if unit.returncode != 0 or " passed" not in summary:
        problems.append(f"the unit tier failed under torch {got[0]}, ipyparallel {got[1]} "
                        f"({unit.returncode}): {summary}\n{unit.stdout[-8000:]}\n"
                        f"{unit.stderr[-3000:]}")
    if smoke.returncode != 0 or smoke.stdout.strip().splitlines()[-1:] != ["SMOKE PASSED"]:
        problems.append(f"the 2-rank smoke failed under torch {got[0]}, ipyparallel {got[1]} "
                        f"({smoke.returncode}):\n{smoke.stdout[-3000:]}\n{smoke.stderr[-6000:]}")
    assert not problems, "\n\n".join(problems)
