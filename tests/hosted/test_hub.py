"""dpnb behind a real JupyterHub with two real Unix users.

A real Hub (the ``jupyterhub`` package, npm's ``configurable-http-proxy`` in
front, as .ci/run installs them) with two Unix users the test creates (and
removes afterwards, also on failure), Hub users of the same names (dummy
authenticator) and the Hub's default ``LocalProcessSpawner``: each user's
single-user server, kernels and engines run *as that user*, with a home of
their own.  Each server is started through the Hub's REST API with a service
token; each user gets a token of their own.

Running the tests' Python as another user: this venv's interpreter may sit
under a 0700 folder (``/root/.pyenv``, a root-only checkout).  A hosted
server installs its Python where every user can run it, so for the tests'
duration each ancestor folder of the interpreter, the venv and the checkout
that lacks it gets the *search* bit for others (o+x: enter a known path, not
list it); the exact modes are restored afterwards, also on failure.  Nothing
of dpnb's is loosened.

A hosted server's constraints hold for every server: the Hub runs in a mount
namespace of its own whose ``/dev/shm`` is a 64 MB tmpfs (Docker's default),
the servers' PATH has no ssh client, and alice's home is read-only (the
server's runtime files go elsewhere, as hosted images arrange).

``test_each_user_sees_only_their_clusters...``: alice's ``--keep`` is refused
in one line naming what to set (no writable folder for its record); her
kernel starts a 2-rank cluster and trains a few DDP steps; through the proxy her
/api/dpnb/clusters lists it, bob's lists nothing, bob's token (or none) can
neither read hers nor act on her cluster; her engines run as her, her
publication and private folder are hers (0600 / 0700), bob cannot connect
to her side-door sockets and her store greets him with a nonce and drops
him.  Then the Hub stops her server: no process of the cluster is left.

``test_kernel_culling...``: bob's server culls idle kernels (jupyter_server's
own ``MappingKernelManager`` culler, per-kernelspec timeout): culling a
kernel stops its cluster with no process left; a ``--keep`` cluster survives
the cull and a new kernel attaches to it with its engines' state.

    python -m pytest -m hosted tests/hosted
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from helpers import kernelreply, labpage
from helpers import nbutil as nbu

pytestmark = pytest.mark.hosted

CHP = shutil.which("configurable-http-proxy") or os.environ.get("DPNB_CHP", "")
INTRUDER = nbu.REPO / "tests" / "helpers" / "intruder.py"
#: a hosted container's /dev/shm (Docker's default size)
SHM_BYTES = 64 << 20
#: seconds of idleness after which bob's "dpnb-cull" kernels are culled
CULL_S = 4

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
# the default LocalProcessSpawner: each server runs as its Unix user, in their home
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.environment = {{
    "DPNB_PREWARM": "0", "MPLBACKEND": "Agg", "PATH": {path!r},
    # the server's own files outside the home (alice's home is read-only)
    "JUPYTER_RUNTIME_DIR": lambda spawner: os.path.join({homes!r}, "run", spawner.user.name),
    # this checkout's built labextension (as its Python is on PYTHONPATH), not a copy an
    # older editable install left in the venv
    "JUPYTER_PATH": os.path.join({homes!r}, "jupyter-path"),
}}
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 120
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


def _mcp_initialize(url: str, token: str | None) -> tuple[int, bool]:
    """An MCP client's first request to ``url``: (status, whether dpnb's server answered)."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "hosted-test", "version": "0"}}}
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = f"token {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers=headers)
    try:
        with _open(req, timeout=120) as r:
            return r.status, '"name":"dpnb"' in r.read().decode().replace(" ", "")
    except urllib.error.HTTPError as e:
        return e.code, False


def _let_others_traverse(paths: list[str]) -> dict[str, int]:
    """o+x on every ancestor folder of ``paths`` that lacks it; returns {folder: old mode}."""
    changed: dict[str, int] = {}
    for p in paths:
        d = os.path.realpath(p)
        d = d if os.path.isdir(d) else os.path.dirname(d)
        while True:
            mode = stat.S_IMODE(os.stat(d).st_mode)
            if not mode & stat.S_IXOTH and d not in changed:
                changed[d] = mode
                os.chmod(d, mode | stat.S_IXOTH)
            if d == os.path.dirname(d):
                break
            d = os.path.dirname(d)
    return changed


def _path_without_ssh(d: Path) -> str:
    """A PATH of one folder: this PATH's programs, linked, all but the ssh client's."""
    d.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for e in os.scandir(folder) if os.path.isdir(folder) else ():
            if e.name not in ("ssh", "scp", "sftp", "slogin") and not (d / e.name).exists():
                os.symlink(e.path, d / e.name)
    return str(d)


def _user_files(home: Path, pw, cull: bool) -> None:
    """The user's own Jupyter config: dpnb's shipped server-extension switch; for the
    culled user, kernel culling (a hosted admin's setting) and a kernelspec whose
    kernels are culled after CULL_S idle seconds (the culler's per-kernelspec timeout);
    for the other, a read-only home (0555: she is not root, so it holds)."""
    run = home.parent / "run" / pw.pw_name  # the server's runtime files, 0700, theirs
    run.mkdir(parents=True)
    os.chown(run, pw.pw_uid, pw.pw_gid)
    os.chmod(run, 0o700)
    conf = home / ".jupyter" / "jupyter_server_config.d"
    conf.mkdir(parents=True)
    shutil.copy(nbu.REPO / "jupyter-config" / "jupyter_server_config.d" / "dpnb.json", conf)
    if cull:
        (home / ".jupyter" / "jupyter_server_config.json").write_text(json.dumps(
            {"MappingKernelManager": {"cull_idle_timeout": 3600, "cull_interval": 1}}))
        spec = home / ".local" / "share" / "jupyter" / "kernels" / "dpnb-cull"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "culled", "language": "python",
            "metadata": {"cull_idle_timeout": CULL_S}}))
    for p in [home, *home.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    if not cull:
        for p in [home, *home.rglob("*")]:
            os.chmod(p, 0o555 if p.is_dir() else 0o444)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("hosted tier: needs root (creates two Unix users the Hub spawns as)")
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        pytest.skip("the jupyterhub package is not installed (pip install jupyterhub)")
    if not shutil.which("unshare"):
        pytest.skip("hosted tier: needs unshare (util-linux) for a container's small /dev/shm")
    if not CHP:
        pytest.skip("configurable-http-proxy is not on PATH (npm install -g configurable-http-proxy)")
    root = tmp_path_factory.mktemp("hub")
    homes = Path(tempfile.mkdtemp(prefix="dpnb-hub-homes-"))
    os.chmod(homes, 0o755)
    tag = secrets.token_hex(3)
    users = {"alice": f"dpnba{tag}", "bob": f"dpnbb{tag}"}
    made, changed, proc = [], {}, None
    base, token = f"http://127.0.0.1:{nbu.free_port()}", secrets.token_hex(16)
    try:
        for role, name in users.items():
            subprocess.run(["useradd", "-m", "-d", str(homes / name), "-s", "/bin/sh", name],
                           check=True, capture_output=True)
            made.append(name)
            _user_files(homes / name, pwd.getpwnam(name), cull=role == "bob")
        (homes / "jupyter-path" / "labextensions").mkdir(parents=True)
        os.symlink(nbu.REPO / "dpnb" / "labextension", homes / "jupyter-path" / "labextensions" / "dpnb")
        changed = _let_others_traverse([sys.executable, sys.prefix, sys.base_prefix,
                                        str(nbu.REPO), *site.getsitepackages()])
        (root / "jupyterhub_config.py").write_text(CONFIG.format(
            root=str(root), port=int(base.rsplit(":", 1)[1]), hub_port=nbu.free_port(),
            api_port=nbu.free_port(), chp=CHP, users=set(users.values()), token=token,
            path=_path_without_ssh(homes / "bin"), homes=str(homes)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(nbu.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        log = open(root / "hub.log", "w")
        # the Hub and every server, kernel and engine under it in a mount namespace
        # of their own whose /dev/shm is a 64 MB tmpfs, as in a Docker container
        shm = (f"mount -t tmpfs -o size={SHM_BYTES},mode=1777 dpnb-shm /dev/shm"
               ' && exec "$@"')
        proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", shm,
                                 "sh", sys.executable, "-m", "jupyterhub", "-f",
                                 str(root / "jupyterhub_config.py")], cwd=root, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
        tokens = {role: _start_server(base, token, name, root) for role, name in users.items()}
        yield {"base": base, "admin": token, "root": root, "users": users, "tokens": tokens,
               "homes": homes}
    finally:
        if proc is not None:
            for name in users.values():
                try:
                    _req(f"{base}/hub/api/users/{name}/server", token, "DELETE")
                except OSError as e:
                    print(f"stopping {name}'s server: {e}")
            nbu.stop_process(proc)  # by PID; then the proxy and servers it started
            log.close()
        for d, mode in changed.items():
            os.chmod(d, mode)
        for name in made:
            _kill_all_of(pwd.getpwnam(name).pw_uid)  # nothing of theirs may outlive them
            subprocess.run(["userdel", "-r", name], capture_output=True)
        shutil.rmtree(homes, ignore_errors=True)


def _kill_all_of(uid: int) -> None:
    for p in psutil.process_iter(["uids", "status", "cmdline"]):
        if p.info["uids"] and p.info["uids"].real == uid \
                and p.info["status"] != psutil.STATUS_ZOMBIE:  # a zombie's parent reaps it
            print(f"left behind by uid {uid}: {p.pid} {p.info['cmdline']}")
            try:
                p.kill()
            except psutil.Error as e:
                print(f"killing {p.pid}: {e}")


def _start_server(base: str, token: str, user: str, root: Path) -> str:
    """Start ``user``'s server through the Hub's API; a token of the user's own."""
    status, body = _req(f"{base}/hub/api/users/{user}/server", token, "POST", {})
    assert status in (201, 202), body
    deadline = time.monotonic() + 120
    while not (_req(f"{base}/hub/api/users/{user}", token)[1].get("servers", {})
               .get("", {}).get("ready")):
        assert time.monotonic() < deadline, (root / "hub.log").read_text()[-3000:]
        time.sleep(0.5)
    status, body = _req(f"{base}/hub/api/users/{user}/tokens", token, "POST",
                        {"note": "dpnb hosted test", "expires_in": 3600})
    assert status == 201, body
    return body["token"]


def _kernel(h: dict, role: str, spec: str = "python3") -> tuple[str, str]:
    api = f"{h['base']}/user/{h['users'][role]}/api"
    status, k = _req(f"{api}/kernels", h["tokens"][role], "POST", {"name": spec})
    assert status == 201, k
    return api, k["id"]


@contextlib.contextmanager
def _watched(h: dict, role: str, kernel_id: str):
    """A browser tab's hold on the kernel: its websocket open, as Lab keeps it while
    a notebook is open. The culler leaves a connected kernel alone (jupyter_server's
    ``cull_connected`` is off), so a kernel is culled only once this is closed -- not
    while a loaded machine is still starting it (its idle clock runs from its start)."""
    import websocket  # (jupyter_server's own dependency: websocket-client)

    url = (f"{h['base'].replace('http', 'ws', 1)}/user/{h['users'][role]}"
           f"/api/kernels/{kernel_id}/channels")
    ws = websocket.create_connection(url, timeout=60,
                                     header=[f"Authorization: token {h['tokens'][role]}"])
    try:
        yield
    finally:
        ws.close()


def _run(h: dict, role: str, kernel_id: str, code: str) -> str:
    """Run ``code`` in the user's kernel (as root, through its connection file); its stdout."""
    cf = h["homes"] / "run" / h["users"][role] / f"kernel-{kernel_id}.json"
    try:
        kc = kernelreply.connected(cf)
    except RuntimeError as e:
        # what the user's server says of the kernel, and the Hub's log (the
        # single-user servers write to it), for a kernel that really ended
        api = f"{h['base']}/user/{h['users'][role]}/api"
        state = _req(f"{api}/kernels/{kernel_id}", h["tokens"][role])
        raise AssertionError(f"{e}; the server says {state}; the Hub's log ends:\n"
                             f"{(h['root'] / 'hub.log').read_text()[-3000:]}") from e
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    try:
        reply = kc.execute_interactive(code, timeout=180, output_hook=hook)
        assert reply["content"]["status"] == "ok", (reply["content"], "".join(out))
    finally:
        kc.stop_channels()
    return "".join(out)


INFO = ("import json, os, shutil, dpnb\nc = dpnb.get_cluster()\ns = os.statvfs('/dev/shm')\n"
        "print(json.dumps({'id': c.cluster_id, 'pids': [r.pid for r in c.ranks], "
        "'port': c.master_port, 'doors': [a for a, _ in c.transport.doors.values()], "
        "'shm': s.f_blocks * s.f_frsize, 'ssh': shutil.which('ssh'), "
        "'profile': c.profile_dir, 'record': c.published.path, "
        "'agent_door': c.agent_door.path}))")
KEEP_REFUSED = ("%load_ext dpnb\nfrom IPython.core.error import UsageError\ntry:\n"
                "    get_ipython().run_line_magic('dp', 'start -n 2 --keep 1h')\n"
                "except UsageError as e:\n    print('REFUSED', e)")
#: a few DDP training steps on every rank
TRAIN = ("%%dp\nm = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
         "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nfor _ in range(3):\n"
         "    opt.zero_grad(); m(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()\n"
         "x = torch.ones(1); dist.all_reduce(x)\nassert x.item() == 2")


def _info(h: dict, role: str, kernel_id: str) -> dict:
    return json.loads(_run(h, role, kernel_id, INFO).strip().splitlines()[-1])


def _gone(pids: list[int], timeout: float = 60) -> list:
    _, left = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                timeout=timeout)
    return left


def _private(path: str, uid: int, mode: int) -> None:
    st = os.stat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, mode), (path, st.st_uid, oct(st.st_mode))


def test_each_user_sees_only_their_clusters_and_no_other_token_gets_in(hub):
    h, tok = hub, hub["tokens"]
    alice, bob = (pwd.getpwnam(h["users"][r]) for r in ("alice", "bob"))
    api, kid = _kernel(h, "alice")
    bob_api = f"{h['base']}/user/{bob.pw_name}/api"
    info = {"pids": []}
    try:
        # a read-only home: --keep says in one line what to set, before anything starts
        refused = _run(h, "alice", kid, KEEP_REFUSED)
        assert refused.startswith("REFUSED") and "set DPNB_STATE_DIR" in refused, refused
        assert len(refused.strip().splitlines()) == 1, refused
        _run(h, "alice", kid, "%dp start -n 2 --timeout 10")
        _run(h, "alice", kid, TRAIN)
        info = _info(h, "alice", kid)
        # ... under a hosted server's constraints: a 64 MB /dev/shm, no ssh client
        assert info["shm"] == SHM_BYTES and info["ssh"] is None, info
        deadline = time.monotonic() + 30  # published within about a second
        while not (cs := _req(f"{api}/dpnb/clusters", tok["alice"])[1]["clusters"]):
            assert time.monotonic() < deadline, "alice's cluster never listed"
            time.sleep(0.3)
        [c] = cs
        assert c["id"] == info["id"] and c["kernel_id"] == kid and c["alive"] == 2, c
        assert sorted(r["pid"] for r in c["ranks"]) == sorted(info["pids"]), (c, info)
        assert _req(f"{bob_api}/dpnb/clusters", tok["bob"]) == (200, {"clusters": []})
        # bob's token, or none, on alice's server: refused by the Hub's auth, read or act
        for token in (tok["bob"], None):
            status, body = _req(f"{api}/dpnb/clusters", token)
            assert status in (302, 403) and c["id"] not in str(body), (status, body)
            status, body = _req(f"{api}/dpnb/clusters/{c['id']}/interrupt", token, "POST")
            assert status in (302, 403), (status, body)
        # the shared-host guarantees, under the Hub: her engines run as her; her
        # publication and private folder are hers alone; bob cannot reach her side
        # doors, and her store greets him with a nonce and drops him
        assert {psutil.Process(p).uids().real for p in info["pids"]} == {alice.pw_uid}
        assert os.path.basename(info["record"]) == f"{c['id']}.json", info
        _private(info["record"], alice.pw_uid, 0o600)
        _private(os.path.dirname(info["record"]), alice.pw_uid, 0o700)
        assert info["doors"], info
        for door in info["doors"]:
            assert stat.S_ISSOCK(os.stat(door).st_mode)
            _private(os.path.dirname(door), alice.pw_uid, 0o700)
        p = subprocess.run([sys.executable, str(INTRUDER), "--as", bob.pw_name, json.dumps(
            {"raw": [["127.0.0.1", info["port"]]], "unix": info["doors"] + [info["agent_door"]]})],
            capture_output=True, text=True, timeout=60)
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["uid"] == bob.pw_uid, got
        assert all(u == {"connected": False, "error": "PermissionError"} for u in got["unix"])
        (raw,) = got["raw"]
        assert raw["greeting_bytes"] == 32 and raw.get("answer", "") == "", raw
        # her agent reaches her cluster through the Hub with her token (/dpnb/mcp, the
        # same auth as /api/dpnb); bob's token, or none, is refused before any tool
        mcp_url = f"{h['base']}/user/{alice.pw_name}/dpnb/mcp/{c['id']}"
        assert _mcp_initialize(mcp_url, tok["alice"]) == (200, True)
        for token in (tok["bob"], None):
            status, said = _mcp_initialize(mcp_url, token)
            assert status in (302, 403) and not said, status
    finally:
        # the Hub stops alice's server: it shuts its kernels down, and the
        # kernel's exit stops its (not kept) cluster
        status, body = _req(f"{h['base']}/hub/api/users/{alice.pw_name}/server",
                            h["admin"], "DELETE")
        assert status in (202, 204), body
    assert info["pids"] and not _gone(info["pids"])


def test_kernel_culling_stops_its_cluster_and_a_kept_one_survives_to_attach(hub):
    h, tok = hub, hub["tokens"]
    # each kernel held open (a tab's websocket) from its start until its cells are
    # done: then idle, and culled CULL_S seconds later
    api, gone_k = _kernel(h, "bob", "dpnb-cull")
    with _watched(h, "bob", gone_k):
        _run(h, "bob", gone_k, "%load_ext dpnb\n%dp start -n 1 --timeout 10")
        plain = _info(h, "bob", gone_k)
    _, kept_k = _kernel(h, "bob", "dpnb-cull")
    with _watched(h, "bob", kept_k):
        _run(h, "bob", kept_k, "%load_ext dpnb\n%dp start -n 1 --keep 10m --timeout 10")
        _run(h, "bob", kept_k, "%%dp\nmark = 42")
        kept = _info(h, "bob", kept_k)
    assert plain["pids"] and kept["pids"]
    # both kernels idle: culled after CULL_S seconds (the culler looks every second)
    deadline = time.monotonic() + CULL_S + 60  # only "not hung"
    while {k["id"] for k in _req(f"{api}/kernels", tok["bob"])[1]} & {gone_k, kept_k}:
        assert time.monotonic() < deadline, "bob's idle kernels were never culled"
        time.sleep(0.5)
    assert not _gone(plain["pids"]), "the culled kernel's cluster left processes"
    # ... and no files: its profile (the controller's keys) and its publication, which
    # only dpnb's own stop removes (ipyparallel's exit hook stops the engines too)
    deadline = time.monotonic() + 20  # the kernel's exit: seconds; only "not hung"
    while left := [f for f in (plain["profile"], plain["record"]) if os.path.exists(f)]:
        assert time.monotonic() < deadline, f"the culled kernel's cluster left {left}"
        time.sleep(0.3)
    assert all(psutil.pid_exists(p) for p in kept["pids"]), "the kept cluster died with its kernel"
    # the panel lists it, free; a new kernel attaches, finds the engines' state, stops it
    [c] = _req(f"{api}/dpnb/clusters", tok["bob"])[1]["clusters"]
    assert c["id"] == kept["id"] and c["kept"] and c["alive"] == 1, c
    assert _req(f"{api}/dpnb/clusters/{c['id']}/attach-code", tok["bob"], "POST")[1] == \
        {"code": f"%dp attach {c['id']}"}
    _, new_k = _kernel(h, "bob")
    _run(h, "bob", new_k, f"%load_ext dpnb\n%dp attach {c['id']}")
    _run(h, "bob", new_k, "%%dp\nassert mark == 42")
    _run(h, "bob", new_k, "%dp stop")
    assert not _gone(kept["pids"])


def _bob_lab_files(h: dict) -> None:
    """Bob's quick start (up to its stop cell: the Hub stops this cluster) and his Lab
    settings: the app reachable by the test's page, every cell in the DOM."""
    pw = pwd.getpwnam(h["users"]["bob"])
    home = h["homes"] / pw.pw_name
    nb = json.loads((nbu.REPO / "notebooks" / "00_quickstart.ipynb").read_text())
    stop = next(i for i, c in enumerate(nb["cells"]) if "".join(c["source"]).startswith("## 6. Stop"))
    nb["cells"] = nb["cells"][:stop]
    files = {home / "quickstart.ipynb": nb,
             home / ".jupyter" / "labconfig" / "page_config.json": {
                 "exposeAppInBrowser": True,
                 "disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}},
             home / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
             / "tracker.jupyterlab-settings": {"windowingMode": "none"}}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    for p in [home, *home.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)


def _wait_page(page, pred, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s  # only "not hung" on a loaded 2-core machine
    while not (out := pred()):
        assert time.monotonic() < deadline, f"{what} (after {timeout_s} s)"
        page.wait_for_timeout(300)
    return out


@pytest.mark.timeout(900)
def test_in_chromium_a_user_logs_in_spawns_runs_the_quick_start_and_the_hub_stops_it(hub):
    """The hosted flow in a real browser, through the Hub's pages and its proxy: bob
    signs in, the Hub spawns his server, JupyterLab opens the quick start and runs it
    (2 ranks, 20 DDP steps); dpnb's sidebar lists his cluster and its Panel button
    opens the training dashboard, which draws its loss; the Hub's control panel stops his server, and
    no process of the cluster -- none of bob's at all -- is left."""
    why = nbu.browser_missing()
    if why:
        pytest.skip(why)
    h = hub
    bob = pwd.getpwnam(h["users"]["bob"])
    # his server from the module's start stopped: this one is spawned from the Hub's page
    status, body = _req(f"{h['base']}/hub/api/users/{bob.pw_name}/server", h["admin"], "DELETE")
    assert status in (202, 204), body
    deadline = time.monotonic() + 60
    while _req(f"{h['base']}/hub/api/users/{bob.pw_name}", h["admin"])[1].get("servers"):
        assert time.monotonic() < deadline, "bob's first server did not stop"
        time.sleep(0.5)
    _bob_lab_files(h)
    artifacts = nbu.ARTIFACTS / "hosted"
    artifacts.mkdir(parents=True, exist_ok=True)
    pids: list[int] = []
    with nbu.chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{h['base']}/hub/login", timeout=90_000)
            page.fill("#username_input", bob.pw_name)
            page.fill("#password_input", "any")  # the dummy authenticator
            page.click("#login_submit")
            # the Hub spawns his server (spawn-pending), then sends him to it
            page.wait_for_url(re.compile(rf"/user/{bob.pw_name}/"), timeout=180_000)
            # the notebook's session made first, on its own kernelspec: with two kernelspecs
            # (his culled one too) Lab may otherwise ask which, and an answer cancels Run All
            api = f"{h['base']}/user/{bob.pw_name}/api"
            status, sess = _req(f"{api}/sessions", h["tokens"]["bob"], "POST", {
                "path": "quickstart.ipynb", "name": "quickstart.ipynb", "type": "notebook",
                "kernel": {"name": "python3"}})
            assert status == 201, sess
            page.goto(f"{h['base']}/user/{bob.pw_name}/lab/tree/quickstart.ipynb", timeout=90_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=120_000)
            _wait_page(page, lambda: page.evaluate("() => !!window.jupyterapp"), "Lab's app", 60)
            # bob has two kernelspecs (the culled one too): Lab may ask which; the default
            def kernel_idle() -> int:
                labpage._select_kernel_if_asked(page)
                return page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').count()

            _wait_page(page, kernel_idle, "the kernel", 120)
            # Run All (not awaited: the command's promise ends only when every cell has run);
            # again if Lab asked for a kernel instead of running (the answer cancels the run)
            prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt")
            for _ in range(5):
                page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
                page.wait_for_timeout(3000)
                labpage._select_kernel_if_asked(page)
                if any(re.match(r"\[\d+\]", t.strip()) for t in prompts.all_inner_texts()):
                    break
            else:
                pytest.fail("Run All never started the quick start's cells")
            sidebar = page.locator("#dpnb-sidebar")
            shown: list = []
            ran: list = []  # when the quick start's last cell had run

            def listed() -> bool:
                labpage._select_kernel_if_asked(page)  # asked again when run-all starts it
                if not shown and not page.locator(".jp-Dialog").count():
                    page.locator('.jp-SideBar .lm-TabBar-tab[data-id="dpnb-sidebar"]').click()
                    shown.append(True)
                if not ran and re.fullmatch(r"\[\d+\]:", prompts.last.inner_text().strip()):
                    ran.append(time.monotonic())
                # the sidebar polls every second: 15 s after the notebook ran is "never"
                assert not ran or time.monotonic() - ran[0] < 15, \
                    f"the quick start ran, and the sidebar says: {sidebar.inner_text()!r}"
                return bool(shown) and "2 ranks" in sidebar.inner_text() \
                    and "step 19 · loss" in sidebar.inner_text()

            _wait_page(page, listed, "his cluster in dpnb's sidebar, trained 20 steps", 240)
            _wait_page(page, lambda: "Memory" in page.locator(".jp-Notebook").inner_text()
                       and page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]')
                       .count(), "the quick start run to its end", 120)
            cid = sidebar.locator(".dpnb-cluster").get_attribute("data-cluster-id")
            # the card's Panel: the training dashboard, its loss chart's axes titled
            sidebar.locator("button[data-action=panel]").click()
            board = page.locator(f"#jp-main-dock-panel #dpnb-panel-{cid}.dpnb-panel")
            _wait_page(page, lambda: board.count() == 1 and {"step", "loss"}
                       <= set(board.locator(".dpnb-curve svg text").all_text_contents()),
                       "the training dashboard beside the notebook", 30)
            page.screenshot(path=str(artifacts / "hub-lab.png"))
            pids = [int(t) for t in re.findall(r"pid (\d+)", sidebar.inner_text())]
            assert len(pids) == 2 and all(psutil.Process(p).uids().real == bob.pw_uid for p in pids)
            # the Hub's control panel: Stop My Server
            page.goto(f"{h['base']}/hub/home", timeout=60_000)
            page.click("#stop")
            _wait_page(page, lambda: page.locator("#start").is_visible(), "his server stopped", 120)
        except Exception:
            page.screenshot(path=str(artifacts / "hub-lab-failure.png"))
            raise
    assert not _gone(pids, 60), "the stopped server's cluster left processes"
    t0 = time.monotonic()
    deadline = t0 + 30  # the reaper's stop of what the kernel left: seconds
    while left := [(p.pid, p.info["cmdline"]) for p in psutil.process_iter(["uids", "cmdline"])
                   if p.info["uids"] and p.info["uids"].real == bob.pw_uid
                   and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, \
            f"bob's processes left after the Hub stopped his server: {left}"
        time.sleep(0.5)
    print(f"none of bob's processes left {time.monotonic() - t0:.1f} s after his engines exited")
