"""The Binder files work: a fresh environment built from binder/ runs a 2-rank
cluster in its own "Python 3 (dpnb)" kernel.

Does what repo2docker does, in a fresh venv (minutes: it installs torch,
JupyterLab and dpnb):

1. copy the repository as a clone would have it (no build outputs);
2. ``pip install -r binder/requirements.txt -c constraints-cpu.txt``;
3. run ``binder/postBuild`` from the repository root, with the venv first on
   PATH (it installs dpnb, the kernelspec and checks the widget extension);
4. execute a small notebook (start 2 ranks, one all_reduce cell) with nbclient
   in the kernel that postBuild installed, and check that its dpnb is the
   venv's.  The quick start itself is executed by the notebook tier
   (tests/notebook/test_execute.py); here only the Binder environment is new.

The venv with binder/requirements.txt installed is kept across runs, as
repo2docker keeps an image's layers (``~/.cache/dpnb/binder-venv/KEY``, KEY
a hash of the requirements as installed here, the constraints and the
Python version; rebuilt weekly and whenever any of them changes); postBuild
-- dpnb itself, the kernelspec, the page config -- runs from this copy every
time.

    python -m pytest -m slow tests/slow/test_binder.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest


from helpers import nbutil as nbu
BINDER = nbu.REPO / "binder"


def _reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except Exception:
        return False


def requirements_for_here(src: Path, dst: Path) -> list[str]:
    """Copy ``src`` to ``dst`` without the index lines this machine cannot
    reach; return the lines dropped.

    binder/requirements.txt names PyTorch's CPU index (download.pytorch.org)
    for torch==2.13.0+cpu.  On Binder that index is reachable; on an offline
    test machine it is not, and pip would retry it for a long while before
    falling back.  Such a machine provides the same wheel through pip's
    ``find-links`` (e.g. /opt/wheels in pip.conf), so the line is dropped here
    and the rest of the file is installed exactly as written -- the pins are
    still checked, only the place the wheel comes from changes."""
    kept, dropped = [], []
    for line in src.read_text().splitlines():
        words = line.split()
        if words and words[0] in ("--extra-index-url", "--index-url", "-i") and len(words) > 1:
            if not _reachable(words[1].rstrip("/") + "/torch/"):
                dropped.append(line)
                continue
        kept.append(line)
    dst.write_text("\n".join(kept) + "\n")
    return dropped


def _small_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%dp start -n 2",
        "%%dp\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
        "print(f'all_reduce gives {t.item():g}')",
        "%dp stop")]
    nbformat.write(nb, str(path))


def _sh(cmd, *, env, cwd, timeout):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (f"{cmd} failed ({p.returncode}):\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p.stdout


@pytest.mark.timeout(1800)
def test_binder_env_runs_a_cluster_in_its_kernel(tmp_path):
    repo = nbu.copy_worktree(tmp_path / "repo")
    req = tmp_path / "requirements-here.txt"
    dropped = requirements_for_here(repo / "binder" / "requirements.txt", req)
    if dropped:
        print(f"unreachable here, left out: {dropped}")
    kept = nbu.KeptVenv.of("binder-venv", req.read_text(), (repo / "constraints-cpu.txt").read_text())
    venv, fresh = kept.path, kept.fresh
    py = nbu.python_in(venv)
    env = {**os.environ, **nbu.jupyter_env(tmp_path / "home"),
           "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for var in ("PYTHONHOME", "JUPYTER_PATH", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    if fresh:  # marked complete once the requirements are in: an interrupted build is redone
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        _sh([py, "-m", "pip", "install", "-q", "-r", str(req), "-c", "constraints-cpu.txt"],
            env=env, cwd=repo, timeout=1200)
        kept.done()
    print(f"binder venv: {'built' if fresh else 'kept'} ({venv})")
    _sh(["bash", "binder/postBuild"], env=env, cwd=repo, timeout=600)

    # the CPU build, and no CUDA libraries came with it
    out = _sh([py, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
              env=env, cwd=tmp_path, timeout=120)
    assert out.split() == ["2.13.0+cpu", "False"], out
    freeze = _sh([py, "-m", "pip", "freeze"], env=env, cwd=tmp_path, timeout=120)
    assert "nvidia" not in freeze.lower(), freeze
    assert "dpnb" in freeze and "-e " not in freeze, freeze  # a regular install, like Binder

    kdir = venv / "share" / "jupyter" / "kernels" / "dpnb"
    spec = json.loads((kdir / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (dpnb)"
    assert Path(spec["argv"][0]).parent == venv / "bin", spec["argv"]
    page = json.loads((venv / "etc" / "jupyter" / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"].get("@jupyterlab/apputils-extension:announcements")

    # the Binder kernel drives a cluster (the quick start itself is executed by the
    # notebook and browser tiers; here: that this venv's kernel runs dpnb)
    small = tmp_path / "binder_check.ipynb"
    _small_notebook(small)
    run = nbu.execute_notebook(small, kernel_name="dpnb", cell_timeout=180,
                               env={"JUPYTER_PATH": str(venv / "share" / "jupyter")})
    print(f"a 2-rank cell in the Binder venv's kernel: {run.seconds:.1f} s")
    problems = ([f"a cell failed:\n{run.error}"] if run.error else []) + nbu.errors(run.nb)
    if run.leftover:
        problems.append(f"processes outlived the kernel (killed now): {run.leftover}")
    assert not problems, "\n".join(problems)
    # it really was the venv's kernel: dpnb imported from the venv, not this checkout
    where = subprocess.run([py, "-c", "import dpnb; print(dpnb.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True).stdout
    assert str(venv) in where, where
    assert "all_reduce gives 3" in nbu.cell_text(nbu.find_cell(run.nb, "%%dp"))
    assert "cluster stopped" in nbu.cell_text(nbu.find_cell(run.nb, "%dp stop"))
