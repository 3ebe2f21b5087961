"""dpnb behind a real JupyterHub: each user's /api/dpnb/clusters, and one user's token on the other's.

A real Hub (the ``jupyterhub`` package, npm's ``configurable-http-proxy`` in
front, as .ci/run installs them) with two users, alice and bob (the Hub's
dummy authenticator; ``SimpleLocalProcessSpawner``: their single-user servers
run as this Unix user, each with its own home, Jupyter folders and dpnb
folders -- *not* two Unix users: here the venv's Python lives under a 0700
/root that another user cannot run).  Each server is started through the
Hub's REST API with a service token; each user gets a token of their own.
Alice's notebook kernel starts a 2-rank cluster; through the proxy, alice's
/api/dpnb/clusters lists it, bob's lists nothing, and bob's token can neither
read alice's list nor act on her cluster, and no token gets nothing.  Then
the Hub stops alice's server (what its idle culler does): no process of the
cluster is left, and its publication is dropped at the next read.

    python -m pytest -m hosted tests/hosted
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from helpers import nbutil as nbu

from dpnb.cluster import publish

pytestmark = pytest.mark.hosted

CHP = shutil.which("configurable-http-proxy") or os.environ.get("DPNB_CHP", "")
USERS = ("alice", "bob")

CONFIG = """
import os, sys
c = get_config()
root = {root!r}
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.ConfigurableHTTPProxy.pid_file = os.path.join(root, "proxy.pid")
c.JupyterHub.db_url = "sqlite:///" + os.path.join(root, "hub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(root, "cookie_secret")
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {users!r}
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = os.path.join(root, "home", "{{username}}")
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.args = ["--allow-root"] if os.geteuid() == 0 else []  # CI containers run as root
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 120

def _dir(sub):
    return lambda spawner: os.path.join(root, "home", spawner.user.name, sub)

# every user's own Jupyter and dpnb folders (one Unix user here: see the docstring)
c.Spawner.environment = {{
    "JUPYTER_CONFIG_DIR": _dir("jupyter-config"), "JUPYTER_DATA_DIR": _dir("jupyter-data"),
    "JUPYTER_RUNTIME_DIR": _dir("jupyter-runtime"), "IPYTHONDIR": _dir("ipython"),
    "DPNB_PUBLISH_DIR": _dir("dpnb-published"), "DPNB_STATE_DIR": _dir("dpnb-kept"),
    "DPNB_PREWARM": "0", "MPLBACKEND": "Agg", "JUPYTER_PLATFORM_DIRS": "1",
}}
c.JupyterHub.services = [{{"name": "tester", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "tester", "services": ["tester"],
                            "scopes": ["admin:users", "admin:servers", "tokens"]}}]
"""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k):  # a login redirect is an answer, not a page to follow
        return None


_open = urllib.request.build_opener(_NoRedirect).open


def _req(url: str, token: str | None, method: str = "GET", body: dict | None = None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"token {token}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    try:
        with _open(urllib.request.Request(url, data=data, method=method, headers=headers),
                   timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text.startswith(("{", "[")) else text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:300]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        pytest.skip("the jupyterhub package is not installed (pip install jupyterhub)")
    if not CHP:
        pytest.skip("configurable-http-proxy is not on PATH (npm install -g configurable-http-proxy)")
    root = tmp_path_factory.mktemp("hub")
    for u in USERS:  # the shipped switch enables dpnb's server extension in each user's server
        conf = root / "home" / u / "jupyter-config" / "jupyter_server_config.d"
        conf.mkdir(parents=True)
        shutil.copy(nbu.REPO / "jupyter-config" / "jupyter_server_config.d" / "dpnb.json", conf)
    port, token = nbu.free_port(), secrets.token_hex(16)
    (root / "jupyterhub_config.py").write_text(CONFIG.format(
        root=str(root), port=port, hub_port=nbu.free_port(), api_port=nbu.free_port(),
        chp=CHP, users=set(USERS), token=token))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(nbu.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    log = open(root / "hub.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f",
                             str(root / "jupyterhub_config.py")], cwd=root, env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90  # only "not hung" on a loaded 2-core machine
        while True:
            assert proc.poll() is None, (root / "hub.log").read_text()[-3000:]
            try:
                if _req(f"{base}/hub/api/", token)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "hub.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base, token, root
    finally:
        for u in USERS:
            try:
                _req(f"{base}/hub/api/users/{u}/server", token, "DELETE")
            except OSError as e:
                print(f"stopping {u}'s server: {e}")
        nbu.stop_process(proc)  # by PID; then the proxy and servers it started
        log.close()


def _start_server(base: str, token: str, user: str) -> str:
    """Start ``user``'s server through the Hub's API; a token of the user's own."""
    status, body = _req(f"{base}/hub/api/users/{user}/server", token, "POST", {})
    assert status in (201, 202), body
    deadline = time.monotonic() + 120
    while not (_req(f"{base}/hub/api/users/{user}", token)[1].get("servers", {})
               .get("", {}).get("ready")):
        assert time.monotonic() < deadline, f"{user}'s server not ready in 120 s"
        time.sleep(0.5)
    status, body = _req(f"{base}/hub/api/users/{user}/tokens", token, "POST",
                        {"note": "dpnb hosted test", "expires_in": 3600})
    assert status == 201, body
    return body["token"]


def _run_in_kernel(root: Path, user: str, kernel_id: str, code: str) -> None:
    from jupyter_client import BlockingKernelClient

    cf = root / "home" / user / "jupyter-runtime" / f"kernel-{kernel_id}.json"
    kc = BlockingKernelClient(connection_file=str(cf))
    kc.load_connection_file()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive(code, timeout=180, output_hook=lambda m: None)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()


def test_each_user_sees_only_their_clusters_and_no_other_token_gets_in(hub):
    base, admin, root = hub
    tok = {u: _start_server(base, admin, u) for u in USERS}
    alice, bob = f"{base}/user/alice/api", f"{base}/user/bob/api"
    status, k = _req(f"{alice}/kernels", tok["alice"], "POST", {"name": "python3"})
    assert status == 201, k
    pids = []
    try:
        _run_in_kernel(root, "alice", k["id"], "%load_ext dpnb\n%dp start -n 2 --timeout 10")
        deadline = time.monotonic() + 30  # published within about a second
        while not (cs := _req(f"{alice}/dpnb/clusters", tok["alice"])[1]["clusters"]):
            assert time.monotonic() < deadline, "alice's cluster never listed"
            time.sleep(0.3)
        [c] = cs
        pids = [r["pid"] for r in c["ranks"]]
        assert c["kernel_id"] == k["id"] and c["alive"] == 2, c
        assert _req(f"{bob}/dpnb/clusters", tok["bob"]) == (200, {"clusters": []})
        # bob's token, or none, on alice's server: refused by the Hub's auth, read or act
        for token in (tok["bob"], None):
            status, body = _req(f"{alice}/dpnb/clusters", token)
            assert status in (302, 403) and c["id"] not in str(body), (status, body)
            status, body = _req(f"{alice}/dpnb/clusters/{c['id']}/interrupt", token, "POST")
            assert status in (302, 403), (status, body)
    finally:
        # the Hub stops alice's server, as its idle culler does: the server shuts its
        # kernels down, and the kernel's exit stops its (not kept) cluster
        status, body = _req(f"{base}/hub/api/users/alice/server", admin, "DELETE")
        assert status in (202, 204), body
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, left = psutil.wait_procs(procs, timeout=60)
    assert not left, left
    # the kernel removes its record as it exits (the engines go first); one killed
    # before its atexit leaves it, and the next read (what the API serves) drops it
    published = str(root / "home" / "alice" / "dpnb-published")
    deadline = time.monotonic() + 30  # the kernel's exit: seconds; only "not hung"
    while publish.published(published):
        assert time.monotonic() < deadline, publish.published(published)
        time.sleep(0.3)
    assert not os.listdir(published)
