"""``pip install -e .`` in a fresh venv makes JupyterLab list dpnb's extensions, enabled and OK.

The data files carry both (``share/jupyter/labextensions/dpnb``, the prebuilt
sidebar, and ``etc/jupyter/jupyter_server_config.d/dpnb.json``, the server
extension's switch); setuptools' editable wheel leaves data files out unless
setup.py's fix is there.  Only JupyterLab and psutil are installed beside
dpnb (``--no-deps``: no torch download, the listing needs none), so this
takes seconds, not the minutes of the full install (tests/slow/test_binder.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from helpers import nbutil as nbu

pytestmark = pytest.mark.slow


def test_editable_install_lists_the_lab_and_server_extensions(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = nbu.python_in(venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JUPYTER_PATH",
                                                             "JUPYTER_CONFIG_PATH")}
    env.update(nbu.jupyter_env(tmp_path / "home"), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    subprocess.run([py, "-m", "pip", "install", "-q", "jupyterlab>=4", "psutil"], env=env,
                   check=True, timeout=600)
    t0 = time.monotonic()
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(nbu.REPO)], env=env,
                   check=True, timeout=600, cwd=tmp_path)
    print(f"pip install --no-deps -e . took {time.monotonic() - t0:.1f} s")
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    lab = ansi.sub("", subprocess.run([py, "-m", "jupyter", "labextension", "list"], env=env,
                                      capture_output=True, text=True, timeout=120).stderr)
    import tomllib

    ver = tomllib.loads((nbu.REPO / "pyproject.toml").read_text())["project"]["version"]
    assert re.search(rf"dpnb v{re.escape(ver)} enabled\s+OK \(python, dpnb\)", lab), lab
    srv = subprocess.run([py, "-m", "jupyter", "server", "extension", "list"], env=env,
                         capture_output=True, text=True, timeout=120)
    out = ansi.sub("", srv.stdout + srv.stderr)
    assert re.search(r"dpnb\.lab enabled", out) and re.search(r"dpnb\.lab\s+OK", out), out


#: what the contributor's extras bring and a user's install must not
NOT_FOR_USERS = ("transformers", "lightning-fabric", "playwright", "papermill", "hypothesis",
                 "mcp", "pytest", "accelerate")


def test_the_wheel_carries_the_license_and_the_users_install_pulls_no_test_or_agent_package(
        tmp_path):
    """What an organisation approving dpnb reads: the license text in the wheel
    (PEP 639), and what ``pip install .`` (the README's user install) resolves."""
    import json
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(nbu.REPO)], check=True, timeout=600, cwd=tmp_path)
    (whl,) = tmp_path.glob("dpnb-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert lic, names
        assert z.read(lic[0]).decode().startswith("BSD 3-Clause License")
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in meta, meta[:2000]
    assert "Classifier: Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt" in meta

    report = tmp_path / "report.json"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                    "--report", str(report), "-c", str(nbu.REPO / "constraints-cpu.txt"),
                    str(nbu.REPO)], check=True, timeout=600, cwd=tmp_path)
    print(f"resolving the user's install took {time.monotonic() - t0:.1f} s")
    got = {i["metadata"]["name"].lower().replace("_", "-")
           for i in json.loads(report.read_text())["install"]}
    assert not got & set(NOT_FOR_USERS), sorted(got & set(NOT_FOR_USERS))
    assert {"torch", "ipyparallel", "jupyterlab", "psutil", "nbclient"} <= got, sorted(got)
