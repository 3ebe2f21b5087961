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
    assert re.search(r"dpnb v0\.1\.0 enabled\s+OK \(python, dpnb\)", lab), lab
    srv = subprocess.run([py, "-m", "jupyter", "server", "extension", "list"], env=env,
                         capture_output=True, text=True, timeout=120)
    out = ansi.sub("", srv.stdout + srv.stderr)
    assert re.search(r"dpnb\.lab enabled", out) and re.search(r"dpnb\.lab\s+OK", out), out
