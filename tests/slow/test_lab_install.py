"""What a user's ``pip install .`` gives, in a fresh build: the license in the
wheel (PEP 639 metadata, classifiers) and what the user's install resolves --
none of the test or agent extras' packages.

That an (editable) install lists the lab and server extensions enabled and OK
is checked where a fresh venv installs dpnb anyway, against the oldest
JupyterLab it accepts: ``tests/browser/test_oldest_lab.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from helpers import nbutil as nbu

pytestmark = pytest.mark.slow


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
