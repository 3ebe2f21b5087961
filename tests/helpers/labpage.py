"""JupyterLab in Chromium for the browser tier: a server on a free local port
with temporary state, scratch notebooks, opening one, a full-page screenshot.

Shared by tests/browser's modules (their fixtures ``lab`` and ``browser``
come from here)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import nbutil as nbu

NOTEBOOK = "notebooks/00_quickstart.ipynb"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1: yields (base_url, token)."""
    # no dpnb kernelspec: the notebooks must run on what the install gives
    env = {**os.environ, **nbu.jupyter_env(tmp_path / "home")}
    settings = Path(env["JUPYTERLAB_SETTINGS_DIR"])
    # never write the repository's notebook (Lab autosaves every 2 minutes)
    _write_json(settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings",
                {"autosave": False})
    # every cell in the DOM (Lab 4 may virtualize long notebooks), for the
    # checks and the full-page screenshot
    _write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                {"windowingMode": "none"})
    _write_json(Path(env["JUPYTER_CONFIG_DIR"]) / "labconfig" / "page_config.json",
                {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    port, token = nbu.free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={nbu.REPO}",
           f"--FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root
    log_path = tmp_path / "jupyter-lab.log"
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        nbu.wait_for_lab(server, base, token, log_path)
        yield base, token
    finally:
        nbu.stop_process(server)  # by PID; then whatever it started that outlived it
        log.close()


@pytest.fixture
def browser():
    with nbu.chromium() as b:
        yield b


#: the kernel the course's notebooks name: the default one, no dpnb kernelspec needed
KERNEL = "Python 3 (ipykernel)"


def _select_kernel_if_asked(page) -> None:
    dialog = page.locator(".jp-Dialog")
    if dialog.count() and dialog.locator("select").count():
        dialog.locator("select").select_option(label=KERNEL)
        dialog.locator(".jp-mod-accept").click()


def _scratch_notebook(name: str, sources: list[str]) -> Path:
    """A notebook of code cells under Lab's root (test-artifacts/browser/, git-ignored),
    on the quick start's kernel."""
    artifacts = nbu.ARTIFACTS / "browser"
    artifacts.mkdir(parents=True, exist_ok=True)
    meta = json.loads((nbu.REPO / NOTEBOOK).read_text())["metadata"]
    cells = [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
              "source": s} for s in sources]
    nb_file = artifacts / name
    nb_file.write_text(json.dumps({"cells": cells, "metadata": meta, "nbformat": 4,
                                   "nbformat_minor": 5}))
    return nb_file


def _open_notebook(page, base: str, token: str, notebook: str, goto: bool = True) -> None:
    """Open ``notebook`` (a path under the server's root) in Lab and wait for its
    kernel (``goto=False``: the page already shows it, e.g. after a reload)."""
    if goto:
        page.goto(f"{base}/lab/tree/{notebook}?token={token}", timeout=90_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
    # the notebook's kernel is up (it names it; pick it if Lab asks)
    kname = page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName").first
    deadline = time.monotonic() + 90
    while True:
        _select_kernel_if_asked(page)
        name = kname.inner_text().strip() if kname.count() else ""
        idle = page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').count()
        if name == KERNEL and idle:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the {KERNEL} kernel did not start in 90 s (toolbar says {name!r})")
        page.wait_for_timeout(500)

    # more room for the notebook in the screenshot: fold the file browser
    left = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if left.count():
        left.first.click()


def _screenshot(page, path: Path) -> None:
    """The whole notebook in one image: grow the viewport to fit its height."""
    h = page.evaluate("""() => {
        const o = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer')
               || document.querySelector('.jp-NotebookPanel .jp-Notebook');
        return o ? o.scrollHeight : 1000;
    }""")
    vp = page.viewport_size or {"width": 1400, "height": 1000}
    page.set_viewport_size({"width": vp["width"], "height": max(1000, min(int(h) + 120, 16000))})
    page.wait_for_timeout(800)
    page.evaluate("""() => document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer')
                         .forEach(o => { o.scrollTop = 0; })""")
    page.wait_for_timeout(500)
    page.screenshot(path=str(path), full_page=True)
