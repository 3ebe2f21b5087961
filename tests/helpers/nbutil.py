"""Shared helpers for the notebook, Binder and browser tests.

Imported as ``from helpers import nbutil`` (``tests/`` is on pytest's
``pythonpath``; the shared helpers are the package ``tests/helpers``).

Nothing here starts processes it does not also stop: :func:`execute_notebook`
records every process under the kernel *before* the kernel is shut down and
reports those still alive afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO / "notebooks"
ARTIFACTS = REPO / "test-artifacts"  # git-ignored
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


#: the browser the browser tier drives (Debian's; never one a test downloads)
CHROMIUM = os.environ.get("DPNB_CHROMIUM", "/usr/bin/chromium")


#: Chromium's flags for a headless run in a container, with nothing fetched from outside
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def browser_missing() -> str | None:
    """Why tests/browser cannot drive JupyterLab here, or None when it can."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright Python package is not installed (pip install playwright)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


@contextlib.contextmanager
def chromium():
    """Debian's Chromium under Playwright (the browser tier's), or a skip that
    says what is missing; closed at the end."""
    import pytest  # lazy: nbutil is imported outside pytest too

    why = browser_missing()
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    if not (REPO / "dpnb" / "labextension" / "package.json").exists():
        pytest.fail("dpnb/labextension is not built (see README: In JupyterLab)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def wait_for_lab(server: subprocess.Popen, base: str, token: str, log_path: Path,
                 timeout_s: float = 90.0) -> None:
    """Until ``jupyter lab`` at ``base`` answers its status API; a failure with
    its log when it exits or does not answer in ``timeout_s`` (a loaded 2-core
    machine: the bound says only "not hung")."""
    import urllib.request

    import pytest  # lazy: nbutil is imported outside pytest too

    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited ({server.returncode}):\n"
                        + log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                return
        except OSError:  # not listening yet (URLError and HTTPError are OSErrors)
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer in {timeout_s:.0f} s:\n"
                            + log_path.read_text()[-3000:])
            time.sleep(0.5)


def notebooks() -> list[Path]:
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


# ------------------------------------------------------------------ environment
def jupyter_env(root: Path) -> dict[str, str]:
    """Per-test IPython/Jupyter/JupyterLab state dirs under ``root``."""
    env = {}
    for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                     ("JUPYTER_DATA_DIR", "jupyter-data"),
                     ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                     ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces"),
                     ("MPLCONFIGDIR", "mpl")):
        p = root / sub
        p.mkdir(parents=True, exist_ok=True)
        env[var] = str(p)
    env["MPLBACKEND"] = "Agg"
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    return env


def install_kernelspec(prefix: Path) -> str:
    """Install the "Python 3 (dpnb)" kernelspec (bound to this Python) into
    ``prefix``; return the directory to put on ``JUPYTER_PATH``."""
    from dpnb.cli import install_kernel

    install_kernel(prefix=str(prefix))
    return str(prefix / "share" / "jupyter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes
def descendants(pid: int) -> dict[int, float]:
    """{pid: create_time} of every process below ``pid`` (recursive)."""
    import psutil

    out = {}
    try:
        for c in psutil.Process(pid).children(recursive=True):
            try:
                out[c.pid] = c.create_time()
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


def alive(procs: dict[int, float], wait_s: float = 0.0) -> dict[int, str]:
    """Those of ``procs`` ({pid: create_time}) still running after up to
    ``wait_s`` seconds, as {pid: command line}.  A PID that was recycled by an
    unrelated process (different start time) counts as gone."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for pid, started in procs.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    left[pid] = " ".join(p.cmdline())[:200]
            except psutil.Error:
                pass
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.25)


def kill(procs: dict[int, float]) -> None:
    """SIGKILL those of ``procs`` that are still the processes we recorded."""
    import psutil

    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 0.01:
                p.kill()
        except psutil.Error:
            pass


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Terminate ``proc`` (by PID) and whatever it started that outlives it."""
    below = descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    left = alive(below, wait_s=10.0)
    if left:
        kill({p: below[p] for p in left})


# ------------------------------------------------------------------ execution
@dataclass
class Run:
    nb: object  # the executed nbformat.NotebookNode
    error: BaseException | None  # CellExecutionError (or a timeout) if a cell failed
    kernel_pid: int | None
    # every process seen under the kernel (after each cell and just before shutdown)
    children: dict[int, float] = field(default_factory=dict)
    leftover: dict[int, str] = field(default_factory=dict)  # of those, alive after shutdown
    seconds: float = 0.0


def execute_notebook(path: Path, *, kernel_name: str = "dpnb", cell_timeout: int = 180,
                     startup_timeout: int = 120, env: dict | None = None,
                     leftover_wait_s: float = 20.0) -> Run:
    """Execute ``path`` top to bottom with nbclient in kernel ``kernel_name``.

    Stops at the first failing cell (its error is returned, not raised).  After
    every cell and just before the kernel is shut down, every process under it
    (controller, engines, dpnb's reaper) is recorded by PID and start time; ``leftover``
    lists those still running ``leftover_wait_s`` after the shutdown.  Any
    such leftover is then killed, so a failing test leaves nothing behind.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=cell_timeout,
                            startup_timeout=startup_timeout, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    run = Run(nb=nb, error=None, kernel_pid=None)
    t0 = time.monotonic()
    old_env = {}
    if env:
        old_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits the test process's environment
    try:
        with client.setup_kernel():
            run.kernel_pid = getattr(client.km.provisioner, "pid", None)
            try:
                client.reset_execution_trackers()
                for i, cell in enumerate(nb.cells):
                    try:
                        client.execute_cell(cell, i,
                                            execution_count=client.code_cells_executed + 1)
                    finally:
                        if run.kernel_pid:  # everything ever seen, not only what is left
                            run.children.update(descendants(run.kernel_pid))
                client.set_widgets_metadata()
            except Exception as e:  # CellExecutionError, CellTimeoutError, DeadKernelError
                run.error = e
            finally:
                if run.kernel_pid:
                    run.children.update(descendants(run.kernel_pid))
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    run.seconds = time.monotonic() - t0
    run.leftover = alive(run.children, wait_s=leftover_wait_s)
    if run.leftover:
        kill({p: run.children[p] for p in run.leftover})
    return run


def cell_text(cell) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            parts.append(o["text"])
        elif o["output_type"] in ("display_data", "execute_result"):
            parts.append(o["data"].get("text/plain", ""))
        elif o["output_type"] == "error":
            parts.append("\n".join(o["traceback"]))
    return "".join(parts)


def errors(nb) -> list[str]:
    """One entry per error output, or stderr text naming a traceback/error
    (what JupyterLab shows in red)."""
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o["output_type"] == "error":
                out.append(f"cell {i} ({cell.source.splitlines()[0]!r}): "
                           f"{o['ename']}: {o['evalue']}")
            elif o["output_type"] == "stream" and o["name"] == "stderr" \
                    and re.search(r"Traceback|Error", o["text"]):
                out.append(f"cell {i} ({cell.source.splitlines()[0]!r}): error text on "
                           f"stderr: ...{o['text'][-600:]}")
    return out


def find_cell(nb, prefix: str):
    """The first code cell whose source starts with ``prefix``."""
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith(prefix):
            return cell
    return None


def copy_worktree(dst: Path) -> Path:
    """Copy the repository as a fresh clone would see it (tracked and
    untracked-but-not-ignored files) to ``dst``; returns ``dst``."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        names = None
    if names is None:  # not a git checkout: copy all but the usual ignores
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "test-artifacts",
            ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", "demo-out"))
        return dst
    for name in filter(None, names):
        src = REPO / name
        if not src.is_file():
            continue  # deleted in the work tree
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name)
    return dst


def python_in(venv: Path) -> str:
    return str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))


#: a kept venv older than this is built again (what pip resolves for a fresh user moves on)
KEPT_VENV_MAX_AGE_S = 7 * 24 * 3600


@dataclass
class KeptVenv:
    """A venv kept across test runs under ``$DPNB_VENV_CACHE`` (default ``~/.cache/dpnb``),
    at ``NAME/KEY``: KEY a digest of the Python version and everything the caller says
    the venv's contents depend on (requirement strings, files' text), so any change
    builds a new one; also rebuilt after :data:`KEPT_VENV_MAX_AGE_S`.  ``fresh``: build it
    (the folder is emptied first); call :meth:`done` once its contents are checked, so an
    interrupted build is redone."""

    path: Path
    fresh: bool

    @classmethod
    def of(cls, name: str, *key_parts) -> "KeptVenv":
        import hashlib  # lazy: only the tests that keep a venv

        key = hashlib.sha256(repr((sys.version_info[:2],) + key_parts).encode()).hexdigest()[:16]
        path = Path(os.environ.get("DPNB_VENV_CACHE", Path.home() / ".cache" / "dpnb")) / name / key
        mark = path / "dpnb-complete"
        fresh = not (mark.exists() and time.time() - mark.stat().st_mtime < KEPT_VENV_MAX_AGE_S)
        if fresh:
            shutil.rmtree(path, ignore_errors=True)
            path.parent.mkdir(parents=True, exist_ok=True)
        return cls(path, fresh)

    def done(self) -> None:
        (self.path / "dpnb-complete").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))

    def built_on(self) -> str:
        """When :meth:`done` marked it complete."""
        return (self.path / "dpnb-complete").read_text().strip()
