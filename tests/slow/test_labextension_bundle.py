"""The committed JupyterLab extension bundle (dpnb/labextension/) is what its source builds to.

labextension/ builds with exact tools (package-lock.json, @jupyterlab/builder
pinned) against a fixed core: ``--core-path core``, where
labextension/core/package.json is JupyterLab's own ``jupyterlab/staging/package.json``
of the lowest JupyterLab dpnb supports (copied from that version's wheel, see
labextension/core/README.md).  @jupyterlab/builder takes the shared modules'
``requiredVersion`` from that file (its ``resolutions``/``dependencies``,
``~`` widened to ``^``), so the ranges do not depend on the JupyterLab
installed where the bundle is built.

* ``test_rebuild_matches_committed_bundle`` (needs npm and the npm registry or
  a warm npm cache; minutes when cold): copies labextension/ to a temporary
  folder, ``npm ci``, ``npm run build``, and compares package.json and every
  file of static/ with the committed ones, byte for byte.  The build's digest is
  kept (``~/.cache/dpnb/labextension-build/KEY``, KEY the source's digest and
  node's and npm's versions; a week at most): the same source and the same
  committed bundle again are not rebuilt (saves 45-55 s of most CI runs).
* ``test_shared_ranges_accept_lowest_jupyterlab`` (no npm): every
  @jupyterlab/* range the bundle declares (``jupyterlab.sharedPackages``'
  ``requiredVersion`` and ``dependencies``, the ranges JupyterLab's
  ``labextension list`` compares with its core) accepts the core package
  versions of the lowest JupyterLab that pyproject.toml allows.  Those versions
  come from labextension/core/package.json, whose ``version`` must be that
  lowest JupyterLab: raising the bound in pyproject.toml means replacing that
  file with the new version's staging/package.json and rebuilding.

    python -m pytest -m slow tests/slow/test_labextension_bundle.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import nbutil as nbu

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "labextension"
BUNDLE = REPO / "dpnb" / "labextension"
CORE = SOURCE / "core" / "package.json"


def _files(root: Path) -> dict[str, bytes]:
    """package.json and everything under static/, by path relative to root."""
    out = {"package.json": (root / "package.json").read_bytes()}
    for p in sorted((root / "static").rglob("*")):
        if p.is_file():
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def _run(cmd: list[str], cwd: Path, timeout: float) -> float:
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return time.monotonic() - t0


_IGNORED = ("node_modules", "lib", "tsconfig.tsbuildinfo")


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def _source_files() -> dict[str, bytes]:
    return {p.relative_to(SOURCE).as_posix(): p.read_bytes() for p in sorted(SOURCE.rglob("*"))
            if p.is_file() and not any(part in _IGNORED for part in p.relative_to(SOURCE).parts)}


def _kept_build_is(record, committed: dict[str, bytes]) -> bool:
    """Whether ``record`` (kept, complete) says its source built to ``committed``."""
    return not record.fresh and (record.path / "bundle.sha256").read_text() == _digest(committed)


def test_a_kept_build_stands_only_for_the_bundle_it_built(tmp_path, monkeypatch):
    monkeypatch.setenv("DPNB_VENV_CACHE", str(tmp_path))
    committed = _files(BUNDLE)
    first = nbu.KeptVenv.of("labextension-build", "v20", "10", "source")
    first.path.mkdir(parents=True, exist_ok=True)
    (first.path / "bundle.sha256").write_text(_digest(committed))
    first.done()
    again = nbu.KeptVenv.of("labextension-build", "v20", "10", "source")
    assert _kept_build_is(again, committed)
    name = next(n for n in committed if n.endswith(".js"))
    assert not _kept_build_is(again, committed | {name: committed[name] + b" "})  # one byte more
    assert not _kept_build_is(nbu.KeptVenv.of("labextension-build", "v20", "10", "other"), committed)


@pytest.mark.timeout(1200)
def test_rebuild_matches_committed_bundle(tmp_path):
    """Rebuilt, or -- when this very source (every file of labextension/, with node's
    and npm's versions) was built on this machine within the week -- that build's
    digest compared instead: a rebuild of the same source is the same bytes (this
    test holds it), so the record stands for it.  A changed source or bundle, a
    week-old record or ``DPNB_BUNDLE_REBUILD=1`` rebuilds."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not on PATH: cannot rebuild labextension/")
    tools = [subprocess.run([t, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
             for t in ("node", npm)]
    record = nbu.KeptVenv.of("labextension-build", *tools, _digest(_source_files()))
    committed = _files(BUNDLE)
    if _kept_build_is(record, committed) and os.environ.get("DPNB_BUNDLE_REBUILD") != "1":
        print(f"this source built to the committed bundle on {record.built_on()}: not rebuilt")
        return
    src = tmp_path / "labextension"
    shutil.copytree(SOURCE, src, ignore=shutil.ignore_patterns(*_IGNORED))
    t_ci = _run([npm, "ci", "--no-audit", "--no-fund"], src, timeout=900)
    t_build = _run([npm, "run", "build"], src, timeout=600)
    print(f"npm ci {t_ci:.1f} s, npm run build {t_build:.1f} s")

    built = _files(tmp_path / "dpnb" / "labextension")
    record.path.mkdir(parents=True, exist_ok=True)
    (record.path / "bundle.sha256").write_text(_digest(built))
    record.done()
    problems = [f"  {name}: only in the rebuild" for name in sorted(built.keys() - committed.keys())]
    problems += [f"  {name}: only in dpnb/labextension/" for name in sorted(committed.keys() - built.keys())]
    problems += [f"  {name}: differs" for name in sorted(built.keys() & committed.keys())
                 if built[name] != committed[name]]
    assert not problems, (
        "dpnb/labextension/ is not what labextension/ builds to (npm ci && npm run build "
        "in labextension/, then commit dpnb/labextension/):\n" + "\n".join(problems))


def _lowest_jupyterlab() -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps if Requirement(d).name == "jupyterlab"]
    assert len(reqs) == 1, f"pyproject.toml should list jupyterlab once: {deps}"
    lows = [s.version for s in reqs[0].specifier if s.operator in (">=", "==", "~=")]
    assert len(lows) == 1, f"no single lower bound in {reqs[0]}"
    return lows[0]


def _satisfies(version: str, spec: str) -> bool:
    """npm semver, only the forms used here: ^X.Y.Z (X > 0), ~X.Y.Z, X.Y.Z."""
    m = re.fullmatch(r"([\^~]?)(\d+)\.(\d+)\.(\d+)", spec)
    assert m, f"range {spec!r}: only ^X.Y.Z, ~X.Y.Z and X.Y.Z are checked here"
    op, want = m.group(1), tuple(int(g) for g in m.group(2, 3, 4))
    have = tuple(int(g) for g in re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version).groups())
    if op == "^":
        assert want[0] > 0, spec
        return have >= want and have[0] == want[0]
    if op == "~":
        return have >= want and have[:2] == want[:2]
    return have == want


def test_shared_ranges_accept_lowest_jupyterlab():
    from packaging.version import Version

    lowest = _lowest_jupyterlab()
    core = json.loads(CORE.read_text())
    assert core["name"] == "@jupyterlab/application-top", f"{CORE} is not a JupyterLab staging/package.json"
    assert Version(core["version"]) == Version(lowest), (
        f"pyproject.toml allows jupyterlab {lowest} and up, but the bundle is built against "
        f"JupyterLab {core['version']}'s core ({CORE}): copy jupyterlab/staging/package.json "
        f"of jupyterlab=={lowest} there and rebuild")
    # JupyterLab's own pins (~4.0.0 and the like) name its core packages' versions
    core_versions = {name: rng.lstrip("~^") for name, rng in core["resolutions"].items()
                     if name.startswith("@jupyterlab/")}

    data = json.loads((BUNDLE / "package.json").read_text())
    shared = data["jupyterlab"].get("sharedPackages", {})
    ranges = [(f"sharedPackages[{name}].requiredVersion", name, cfg["requiredVersion"])
              for name, cfg in shared.items() if name.startswith("@jupyterlab/")]
    ranges += [(f"dependencies[{name}]", name, rng) for name, rng in data["dependencies"].items()
               if name.startswith("@jupyterlab/")]
    assert ranges
    bad = [f"  {where} = {rng!r} rejects {name} {core_versions.get(name)} (JupyterLab {core['version']})"
           for where, name, rng in ranges
           if name not in core_versions or not _satisfies(core_versions[name], rng)]
    assert not bad, "dpnb/labextension/package.json:\n" + "\n".join(bad)

    # every @jupyterlab/* module the bundle consumes is one whose range is checked above
    entry = (BUNDLE / data["jupyterlab"]["_build"]["load"]).read_text()
    consumed = set(re.findall(r'"(@jupyterlab/[a-z0-9-]+)"', entry))
    assert consumed, f"no @jupyterlab/* module found in {data['jupyterlab']['_build']['load']}"
    assert consumed <= shared.keys(), (
        f"the bundle consumes {sorted(consumed - shared.keys())} without a "
        "jupyterlab.sharedPackages entry in labextension/package.json")
