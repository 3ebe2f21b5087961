"""``dpnb mcp``'s pure parts: the permission gate, the output caps, the audit log
(:mod:`dpnb.agent.policy`); the server over a real cluster: tests/cluster/test_mcp.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from dpnb._reaper import KEEP_FILE
from dpnb.agent import policy
from dpnb.agent.policy import Need, Permissions


def test_read_tools_are_always_allowed_and_the_others_only_with_their_flag():
    none, acts, code = Permissions(), Permissions(actions=True), Permissions(code=True)
    assert policy.refusal("status", Need.READ, none) is None
    for perms, tool, need, flag in ((none, "restart", Need.ACTIONS, "--allow-actions"),
                                    (code, "restart", Need.ACTIONS, "--allow-actions"),
                                    (none, "run_code", Need.CODE, "--allow-code"),
                                    (acts, "run_code", Need.CODE, "--allow-code")):
        why = policy.refusal(tool, need, perms)
        assert why is not None and why.startswith(f"refused: {tool}") and flag in why
        assert "nothing was done" in why
    assert policy.refusal("restart", Need.ACTIONS, acts) is None
    assert policy.refusal("run_code", Need.CODE, code) is None


def test_a_long_text_keeps_its_head_and_tail_and_says_how_much_was_cut():
    text = "A" * 30_000 + "B" * 30_000
    out = policy.cap_text(text, 1_000)
    assert out.startswith("A" * 666) and out.endswith("B" * 334)
    assert f"{60_000 - 1_000} characters cut" in out and len(out) < 1_100
    assert policy.cap_text("short", 1_000) == "short"


def test_a_result_is_capped_as_a_whole_and_says_so():
    result = {"ranks": {str(r): {"stdout": "x" * 50_000, "status": "ok"} for r in range(8)},
              "ok": True, "n": 3, "pids": (1, 2)}
    out = policy.cap(result, text_cap=20_000, total_cap=100_000)
    assert len(json.dumps(out)) <= 100_000
    assert out["ok"] is True and out["n"] == 3 and out["pids"] == [1, 2]
    assert out["ranks"]["7"]["status"] == "ok" and "characters cut" in out["ranks"]["7"]["stdout"]
    assert "capped" in out
    small = {"a": "b", "c": [1, None]}
    assert policy.cap(small) == small  # nothing cut: no note either


def test_the_audit_log_is_a_private_file_of_one_json_line_per_call(tmp_path):
    path = policy.audit_path(str(tmp_path), "abc")
    rec = policy.audit_record("run_code", {"code": "y" * 10_000, "ranks": "0"}, allowed=False,
                              outcome="refused", seconds=0.01234, cluster_id="abc")
    policy.append_audit(path, rec)
    policy.append_audit(path, policy.audit_record("status", {}, allowed=True, outcome="ok",
                                                  seconds=0.5, cluster_id="abc"))
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert [(r["tool"], r["allowed"], r["outcome"]) for r in lines] == [
        ("run_code", False, "refused"), ("status", True, "ok")]
    assert lines[0]["cluster"] == "abc" and lines[0]["server_pid"] == os.getpid()
    assert lines[0]["args"]["ranks"] == "0" and len(lines[0]["args"]["code"]) < 2_100


def test_the_audit_log_refuses_a_planted_link_or_a_shared_file(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "mcp-audit-x.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        policy.append_audit(str(link), {"tool": "status"})
    shared = tmp_path / "shared.jsonl"
    shared.write_text("")
    shared.chmod(0o644)
    with pytest.raises(PermissionError):
        policy.append_audit(str(shared), {"tool": "status"})
    assert target.read_text() == "" and shared.read_text() == ""


def _fake_kept(state, cid: str) -> None:
    """A kept-cluster record whose reaper file says no kernel holds it."""
    prof = state / f"profile-{cid}"
    prof.mkdir()
    (prof / KEEP_FILE).write_text(json.dumps({"ttl_s": 600, "owner_pid": None,
                                              "detached_at": time.time()}))
    (state / f"{cid}.json").write_text(json.dumps({
        "id": cid, "created": time.time(), "ttl_s": 600, "profile_dir": str(prof),
        "ranks": [{}, {}], "backend": "gloo"}))


def test_dpnb_mcp_says_in_one_line_when_there_is_no_cluster_or_several(
        tmp_path, monkeypatch, capsys):
    """The clusters it may serve: the kept ones no kernel holds, and the running
    kernels' that published a door (dpnb.agent.door)."""
    pytest.importorskip("mcp")  # the agent extra; CI installs it
    from dpnb.cli import main
    from dpnb.cluster.processes import start_time

    monkeypatch.setenv("DPNB_STATE_DIR", str(tmp_path))
    pub = tmp_path / "published"
    pub.mkdir()
    monkeypatch.setenv("DPNB_PUBLISH_DIR", str(pub))
    assert main(["mcp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpnb mcp: no dpnb cluster to serve") and "\n" not in err
    _fake_kept(tmp_path, "aaa")
    _fake_kept(tmp_path, "bbb")
    # a running kernel's cluster (this process plays the kernel), with its door
    (pub / "ccc.json").write_text(json.dumps({
        "id": "ccc", "kernel": {"pid": os.getpid(), "start": start_time(os.getpid())},
        "ranks": [{}, {}], "agent_door": str(tmp_path / "door.sock")}))
    # and one without a door: not served (a kernel of a dpnb before doors)
    (pub / "ddd.json").write_text(json.dumps({
        "id": "ddd", "kernel": {"pid": os.getpid(), "start": start_time(os.getpid())},
        "ranks": [{}, {}]}))
    assert main(["mcp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpnb mcp: 3 clusters: say which with --attach ID (aaa, bbb, ccc)") \
        and "\n" not in err
    assert main(["mcp", "--attach", "zzz"]) == 2
    assert "no cluster 'zzz' to serve" in capsys.readouterr().err
