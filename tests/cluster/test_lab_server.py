"""/api/dpnb/clusters on a real ``jupyter server``: what a kernel started, behind the server's token.

One server (:mod:`helpers.labserver`: dpnb's server extension enabled by its
shipped config file), one kernel started through the server's REST API, one
kept 2-rank cluster started and trained in it.  The token holder sees the
cluster -- its ranks, the kernel that holds it, the training's last step --
and nobody without the token sees or stops anything.  Then the kernel is
shut down through the API: the cluster stays (kept), now free; a rank of it
is killed and the server's restart action replaces it; its stop action ends
the cluster, every process of it gone.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from helpers import kernelreply, labserver

pytestmark = pytest.mark.cluster

TRAIN = """
import dpnb
c = dpnb.get_cluster()
c.run('''
import torch, dpnb.data
ds = dpnb.data.SyntheticRegression(n=64, in_dim=8, out_dim=2, seed=1)
net = torch.nn.Linear(8, 2)
''', display=False, setup=True)
c.wrap("net", "ddp", lr=0.05)
c.set_data("ds")
s = c.train(steps=3, micro_batch=4, progress=False)
print("LOSS", s["loss"])
"""


def _execute(kc, code: str, timeout: float = 180) -> str:
    """Run ``code`` in the kernel; its stream and error text (the reply must be ok)."""
    msg_id = kc.execute(code)
    out = []
    deadline = time.monotonic() + timeout
    while True:
        m = kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        elif m["msg_type"] == "error":
            out.append("\n".join(m["content"]["traceback"]))
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            break
    reply = kernelreply.reply_to(kc, msg_id, timeout=30)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def _wait_for(srv, pred, what: str, timeout: float = 60):
    """The cluster list once ``pred(list)`` holds (the kernel publishes about once a second)."""
    deadline = time.monotonic() + timeout  # only "not hung": it usually holds within 2 s
    while True:
        status, body = srv.request("/api/dpnb/clusters")
        assert status == 200, body
        if pred(body["clusters"]):
            return body["clusters"]
        assert time.monotonic() < deadline, f"{what}: {body}\n{srv.log()}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server for the module (starting one costs seconds); each test leaves no cluster."""
    with labserver.running(tmp_path_factory.mktemp("lab")) as s:
        yield s


@pytest.fixture
def lab(srv):
    yield srv
    labserver.stop_clusters(srv)  # whatever a failed assertion left running


def test_the_token_holder_sees_and_stops_what_a_kernel_started(lab):
    _check(lab)


def _check(srv) -> None:
    status, k = srv.request("/api/kernels", method="POST", body={"name": "python3"})
    assert status == 201, k
    kc = kernelreply.connected(srv.runtime_dir / f"kernel-{k['id']}.json")
    try:
        _execute(kc, "%load_ext dpnb\n%dp start -n 2 --keep 3m --timeout 10")
        assert "LOSS" in _execute(kc, TRAIN)
        [c] = _wait_for(srv, lambda cs: cs and cs[0]["progress"].get("step") == 2,
                        "the trained cluster")
        pids = [r["pid"] for r in c["ranks"]]
        assert c["source"] == "kernel" and c["kernel_id"] == k["id"] and c["kept"]
        assert [(r["rank"], r["alive"]) for r in c["ranks"]] == [(0, True), (1, True)]
        assert c["alive"] == c["world_size"] == 2 and c["progress"]["loss"] > 0
        assert c["last_error"] is None
        # the train call's last step, read from the ranks once it ended, for the Lab panels:
        # each rank's lanes (a DDP all-reduce among them) and its bytes against the exact
        # model (Linear(8, 2): 18 float32 parameters)
        sync, mem = c["gradsync"], c["memory"]
        assert (sync["step"], sync["strategy"], [r["rank"] for r in sync["ranks"]]) == (2, "ddp", [0, 1])
        assert {"forward", "backward", "all_reduce"} <= {b["lane"] for b in sync["ranks"][1]["segments"]}
        assert (mem["strategy"], mem["phase"], mem["step"]) == ("ddp", "after_step", 2)
        assert all(r["measured"] == r["predicted"] and r["measured"][0] == 18 * 4 for r in mem["ranks"])
        # ipyparallel's own sidebar lists plain ipyparallel clusters from IPython's profile
        # folders: never this one (its profile is dpnb's private folder), so a user is not
        # offered a second, wrong stop button (README: "Two cluster sidebars")
        status, ipp = srv.request("/ipyparallel/clusters")
        assert status == 200 and isinstance(ipp, list), ipp
        assert c["id"] not in json.dumps(ipp), ipp
        # no token, a wrong token: refused, for reading and for acting
        for token in (None, "0" * 32):
            assert srv.request("/api/dpnb/clusters", token=token)[0] == 403
            assert srv.request(f"/api/dpnb/clusters/{c['id']}/stop", method="POST",
                               token=token)[0] == 403
        status, body = srv.request(f"/api/dpnb/clusters/{c['id']}/stop", method="POST")
        assert status == 409 and "%dp stop in its notebook" in body["message"], body
        status, body = srv.request(f"/api/dpnb/clusters/{c['id']}/attach-code", method="POST")
        assert (status, body) == (200, {"code": f"%dp attach {c['id']}"})
        assert srv.request("/api/dpnb/clusters/nope/stop", method="POST")[0] == 404
    finally:
        kc.stop_channels()
    # the kernel ends (its atexit lets go): the kept cluster is free, and still listed
    assert srv.request(f"/api/kernels/{k['id']}", method="DELETE")[0] == 204
    [c] = _wait_for(srv, lambda cs: cs and cs[0]["source"] == "kept"
                    and cs[0]["holder"] is None, "the freed kept cluster")
    assert c["alive"] == 2
    # rank 1's engine dies while nobody holds the cluster: the list says so, and the
    # server's restart replaces it (in a process of its own, which lets go again)
    os.kill(pids[1], signal.SIGKILL)
    _wait_for(srv, lambda cs: cs[0]["alive"] == 1, "rank 1 dead in the list")
    status, body = srv.request(f"/api/dpnb/clusters/{c['id']}/restart", method="POST")
    assert status == 200 and "rank 1 replaced" in body["message"], body
    [c] = _wait_for(srv, lambda cs: cs[0]["alive"] == 2 and cs[0]["holder"] is None,
                    "the restarted cluster, free again")
    assert c["ranks"][0]["pid"] == pids[0] and c["ranks"][1]["pid"] != pids[1]
    pids.append(c["ranks"][1]["pid"])
    _stop_leaves_nothing(srv, c["id"], pids)


def _stop_leaves_nothing(srv, cid: str, pids: list[int]) -> None:
    """The stop action on a free cluster: it answers, the list empties, every engine exits."""
    status, body = srv.request(f"/api/dpnb/clusters/{cid}/stop", method="POST")
    assert status == 200 and "stopped cluster" in body["message"], body
    assert srv.request("/api/dpnb/clusters")[1] == {"clusters": []}
    _, left = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                timeout=15)
    assert not left, left


def test_a_cluster_started_from_the_panel_is_kept_attachable_and_stopped(lab, monkeypatch):
    """The sidebar's Start: POST /api/dpnb/clusters/start starts a kept 2-rank cluster in
    a process of the server's; it is listed, free, and this process takes it up with
    dpnb.attach(ID) (as %dp attach does in a notebook), runs a collective, lets go;
    the stop action ends it with nothing left."""
    import dpnb
    from dpnb.cluster import keep as keeping

    for token in (None, "0" * 32):  # behind the server's auth like every /api/dpnb route
        assert lab.request("/api/dpnb/clusters/start", method="POST", token=token,
                           body={"n": 2})[0] == 403
    status, body = lab.request("/api/dpnb/clusters/start", method="POST",
                               body={"n": 2, "launcher": "ssh", "hosts": "a=1"})
    assert status == 400 and "-n 2 but the hosts take 1" in body["message"], body
    status, body = lab.request("/api/dpnb/clusters/start", method="POST",
                               body={"n": 2, "launcher": "local", "keep": "5m"})
    assert status == 200 and body["world_size"] == 2, body
    [c] = _wait_for(lab, lambda cs: cs and cs[0]["alive"] == 2, "the started cluster")
    assert c["id"] == body["id"] and c["kept"] and c["holder"] is None, c
    assert 0 < c["stops_in_s"] <= 300
    pids = [r["pid"] for r in c["ranks"]]
    # usable from code: the records are the server's folders, as a notebook's kernel has them
    for k in ("DPNB_STATE_DIR", "DPNB_PUBLISH_DIR"):
        monkeypatch.setenv(k, lab.env[k])
    status, body = lab.request(f"/api/dpnb/clusters/{c['id']}/attach-code", method="POST")
    assert body == {"code": f"%dp attach {c['id']}"}
    d = dpnb.attach(c["id"])
    try:
        got = d.run("import torch, torch.distributed as dist\n"
                    "t = torch.ones(1); dist.all_reduce(t); print(int(t))", display=False)
        assert got.stdout == {0: "2\n", 1: "2\n"}, got
    finally:
        keeping.release(d)  # let go: the server may act on it
    _wait_for(lab, lambda cs: cs[0]["holder"] is None, "the cluster free again")
    _stop_leaves_nothing(lab, c["id"], pids)


def test_the_readmes_line_hides_ipyparallels_sidebar_and_keeps_dpnbs(srv):
    """README's "Two cluster sidebars": ``jupyter labextension disable
    ipyparallel-labextension`` (the user's level, no rebuild) takes ipyparallel's
    sidebar out of the page JupyterLab serves, and dpnb's stays in it."""
    def page_config() -> dict:
        with urllib.request.urlopen(f"{srv.base}/lab?token={srv.token}", timeout=60) as r:
            html = r.read().decode()
        m = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                      html, re.S)
        assert m, html[:2000]
        return json.loads(m.group(1))

    def names(cfg: dict) -> set:
        return {e["name"] for e in cfg.get("federated_extensions", [])}

    before = page_config()
    assert {"dpnb", "ipyparallel-labextension"} <= names(before)
    assert "ipyparallel-labextension" not in before.get("disabledExtensions", [])
    # the line as the README gives it
    line = re.search(r"^jupyter labextension disable (\S+)$",
                     (labserver.nbu.REPO / "README.md").read_text(), re.M)
    assert line, "README.md gives no `jupyter labextension disable` line"
    p = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "disable", line.group(1)],
                       env=srv.env, capture_output=True, text=True, timeout=120)
    try:
        assert p.returncode == 0, p.stdout + p.stderr
        after = page_config()
        assert "ipyparallel-labextension" in after.get("disabledExtensions", []), after
        assert "dpnb" in names(after) and not any(
            d.startswith("dpnb") for d in after.get("disabledExtensions", [])), after
    finally:  # the module's other tests see Lab as installed
        subprocess.run([sys.executable, "-m", "jupyter", "labextension", "enable",
                        "ipyparallel-labextension"], env=srv.env, capture_output=True, timeout=120)
