"""A real Jupyter server (``jupyter server`` or ``jupyter lab``) with dpnb's extensions, for tests.

Imported as ``from helpers import labserver``.  The server runs on a free
local port with a random token, state folders of the test's own
(:func:`helpers.nbutil.jupyter_env`), the repository on ``PYTHONPATH`` (so the
kernels it starts import this checkout's dpnb), and dpnb's shipped switch
``jupyter-config/jupyter_server_config.d/dpnb.json`` copied into its config
folder: the server extension is enabled the way pip's install enables it.
The labextension is found through ``JUPYTER_PATH`` (``labextensions/dpnb``
pointing at the built ``dpnb/labextension``), as after ``pip install``.
Kernel publications and kept-cluster records go to folders of the test's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import nbutil as nbu


@dataclass
class Server:
    base: str
    token: str
    env: dict
    runtime_dir: Path
    log_path: Path

    def request(self, path: str, *, method: str = "GET", token: str | None = "",
                body: dict | None = None) -> tuple[int, dict]:
        """(status, JSON body) of ``path``; ``token=None`` sends no credential,
        ``""`` the server's own."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"token {token or self.token}"
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=180) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text else {}
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"text": text}

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]


def server_env(root: Path) -> dict:
    env = {**os.environ, **nbu.jupyter_env(root / "home")}
    env["PYTHONPATH"] = os.pathsep.join([str(nbu.REPO)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["DPNB_PUBLISH_DIR"] = str(root / "published")
    env["DPNB_STATE_DIR"] = str(root / "kept")
    env["DPNB_PREWARM"] = "0"  # no zygote started ahead by %load_ext: one cluster only
    conf = Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_server_config.d"
    conf.mkdir(parents=True, exist_ok=True)
    shutil.copy(nbu.REPO / "jupyter-config" / "jupyter_server_config.d" / "dpnb.json", conf)
    data = root / "jupyter-path"
    (data / "labextensions").mkdir(parents=True, exist_ok=True)
    os.symlink(nbu.REPO / "dpnb" / "labextension", data / "labextensions" / "dpnb")
    env["JUPYTER_PATH"] = os.pathsep.join([str(data)] + [p for p in
                                           env.get("JUPYTER_PATH", "").split(os.pathsep) if p])
    return env


@contextlib.contextmanager
def running(root: Path, app: str = "jupyter_server", args=()):
    """Start ``python -m APP`` (``jupyter_server`` or ``jupyterlab``); yield a :class:`Server`."""
    env = server_env(root)
    port, token = nbu.free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", app, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", *args]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root
    log_path = root / f"{app}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=root)
    srv = Server(f"http://127.0.0.1:{port}", token, env,
                 Path(env["JUPYTER_RUNTIME_DIR"]), log_path)
    try:
        deadline = time.monotonic() + 90  # a loaded 2-core machine: only "not hung"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{app} exited ({proc.returncode}):\n{srv.log()}")
            try:
                if srv.request("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{app} did not answer in 90 s:\n{srv.log()}")
            time.sleep(0.5)
        yield srv
    finally:
        nbu.stop_process(proc)  # by PID; then whatever it started that outlived it
        log.close()


def stop_clusters(srv: Server, timeout: float = 60) -> None:
    """Shut every kernel down through the API, then stop the kept clusters they let go
    (a kept cluster outlives its kernel by design; a test's must not)."""
    _, kernels = srv.request("/api/kernels")
    for k in kernels:
        srv.request(f"/api/kernels/{k['id']}", method="DELETE")
    deadline = time.monotonic() + timeout  # the kernels' atexit lets go within seconds
    while time.monotonic() < deadline:
        status, body = srv.request("/api/dpnb/clusters")
        left = body.get("clusters", []) if status == 200 else []
        if not left:
            return
        for c in left:
            if c["holder"] is None:
                srv.request(f"/api/dpnb/clusters/{c['id']}/stop", method="POST")
        time.sleep(0.5)
    raise RuntimeError(f"dpnb clusters left after the test: {left}")
