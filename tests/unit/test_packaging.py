"""What a user and an organisation read before adopting dpnb: one version, the
license, every package dpnb's code imports declared, and ``dpnb doctor``.

The wheel's contents and the user's install's resolution are checked in
``tests/slow/test_lab_install.py``; the oldest declared versions are installed
and run in ``tests/slow/test_oldest_versions.py``.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tomllib

from helpers import nbutil as nbu

REPO = nbu.REPO
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

#: import name -> distribution name, where they differ
DIST = {"IPython": "ipython", "jupyter_server": "jupyter-server", "jupyter_client": "jupyter-client",
        "jupyter_core": "jupyter-core"}
#: imported only inside a guard that says what to install, never needed to run
OPTIONAL = {"pynvml": "doctor's GPU memory: present with CUDA builds of torch",
            "tqdm": "engine/process.py hooks tqdm.autonotebook only if the user imports it",
            "mpi4py": "the mpi extra"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _requirement_names(reqs: list[str]) -> set[str]:
    import re

    return {_norm(re.split(r"[<>=!~;\[ ]", r, 1)[0]) for r in reqs}


def _third_party_imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in (REPO / "dpnb").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names = [n.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "dpnb":
                    out.setdefault(top, set()).add(str(p.relative_to(REPO)))
    return out


def test_every_package_dpnbs_code_imports_is_declared():
    core = _requirement_names(PROJECT["dependencies"])
    extras = {k: _requirement_names(v) for k, v in PROJECT["optional-dependencies"].items()}
    imports = _third_party_imports()
    assert "torch" in imports and "psutil" in imports  # the scan sees dpnb's imports
    missing = []
    for top, where in sorted(imports.items()):
        dist = _norm(DIST.get(top, top))
        if top in OPTIONAL or dist in core:
            continue
        # a package only one extra's modules use may be declared in that extra
        if top in ("mcp", "uvicorn") and dist in extras["agent"]:
            continue
        missing.append(f"{top} (imported by {', '.join(sorted(where)[:3])})")
    assert not missing, "declare in pyproject.toml: " + "; ".join(missing)


def test_nothing_of_the_contributors_extras_is_a_users_dependency():
    core = _requirement_names(PROJECT["dependencies"])
    for extra in ("test", "agent"):
        for name in _requirement_names(PROJECT["optional-dependencies"][extra]):
            assert name not in core, f"{name} is in the {extra} extra and in dependencies"


def test_torch_is_at_least_2_6_where_fsdp2_is_public():
    (torch,) = [r for r in PROJECT["dependencies"] if r.startswith("torch")]
    low = tuple(int(x) for x in torch.split(">=")[1].split(".")[:2])
    assert low >= (2, 6), torch  # torch.distributed.fsdp.fully_shard is public from 2.6


def test_one_version_everywhere():
    ver = PROJECT["version"]
    assert md.version("dpnb") == ver  # the installed metadata
    import dpnb

    assert dpnb.__version__ == ver
    for pkg in ("labextension/package.json", "dpnb/labextension/package.json"):
        assert json.loads((REPO / pkg).read_text())["version"] == ver, pkg
    out = subprocess.run([sys.executable, "-m", "dpnb.cli", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"dpnb {ver}", out


def test_the_license_is_the_declared_one_and_ships():
    assert PROJECT["license"] == "BSD-3-Clause" and PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Redistribution and use" in text


def _doctor(env=None):
    return subprocess.run([sys.executable, "-m", "dpnb.cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_doctor_names_what_dpnb_needs_and_exits_0_with_warnings():
    r = _doctor()
    assert r.returncode == 0, r.stderr
    got = {f["check"]: f for f in json.loads(r.stdout)["findings"]}
    for check in ("dpnb", "python", "torch", "backend", "ipyparallel", "jupyterlab",
                  "labextension", "server extension", "kernelspec", "/dev/shm", "open files",
                  "private folder"):
        assert check in got, (check, sorted(got))
    import torch

    assert got["torch"]["status"] == "OK" and torch.__version__ in got["torch"]["found"]
    assert "gloo" in got["backend"]["found"]  # no GPU here
    assert got["ipyparallel"]["found"].startswith(md.version("ipyparallel"))
    assert all(f["status"] in ("OK", "WARN") for f in got.values()), got
    assert all(f["fix"] for f in got.values() if f["status"] == "WARN"), got


def test_doctor_fails_only_when_dpnb_cannot_run_and_says_what_to_install(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    r = _doctor(env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    got = {f["check"]: f for f in json.loads(r.stdout)["findings"]}
    assert got["torch"]["status"] == "FAIL" and "libtorch_cpu.so" in got["torch"]["found"]
    assert "pip install 'torch>=" in got["torch"]["fix"]
    assert got["ipyparallel"]["status"] == "OK"  # the other checks still ran
