"""Kept-cluster records (``%dp list`` / ``%dp attach``) and TTL parsing, without a cluster."""

import json
import time

import pytest

import dpnb
from dpnb.cluster import keep
from dpnb.errors import DpnbError


@pytest.mark.parametrize("text,s", [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400),
                                    ("1.5h", 5400), ("45", 45), (10, 10.0)])
def test_parse_ttl(text, s):
    assert keep.parse_ttl(text) == s


@pytest.mark.parametrize("bad", ["soon", "", "0", "-1h", "2 weeks", "1y", True])
def test_parse_ttl_refuses(bad):
    with pytest.raises(DpnbError, match="is not a time to live.*90s, 30m, 2h or 1d"):
        keep.parse_ttl(bad)


def _fake(state, tmp_path, cid: str, detached_ago: float = 10.0) -> None:
    prof = tmp_path / f"dpnb-profile-{cid}"
    prof.mkdir()
    (prof / "keep.json").write_text(json.dumps({"ttl_s": 3600, "owner_pid": None,
                                                "detached_at": time.time() - detached_ago}))
    (state / f"{cid}.json").write_text(json.dumps({
        "id": cid, "created": time.time() - 120, "ttl_s": 3600, "profile_dir": str(prof),
        "ranks": [{}, {}], "backend": "gloo"}))


def test_choose_says_none_two_or_which(tmp_path, monkeypatch):
    state = tmp_path / "kept"
    monkeypatch.setenv("DPNB_STATE_DIR", str(state))
    with pytest.raises(DpnbError, match="no kept cluster to attach to: start one"):
        keep.choose(None)
    _fake(state, tmp_path, "111-aaaa")  # the folder exists now: choose() made it
    _fake(state, tmp_path, "222-bbbb", detached_ago=600)
    with pytest.raises(DpnbError, match=r"2 kept clusters: say which with %dp attach ID") as e:
        keep.choose(None)
    assert "111-aaaa: 2 ranks, gloo, up 2 min, TTL 1 h, free, stops in 59.8 min" in str(e.value)
    assert "stops in 50 min" in str(e.value)
    assert keep.choose("222")["id"] == "222-bbbb"
    with pytest.raises(DpnbError, match="no kept cluster '333'"):
        keep.choose("333")
    # a record whose cluster is gone (no keep.json) is dropped, not listed
    (tmp_path / "dpnb-profile-111-aaaa" / "keep.json").unlink()
    assert [r["id"] for r in keep.kept()] == ["222-bbbb"]
    assert sorted(p.name for p in state.iterdir()) == ["222-bbbb.json"]


def test_no_writable_state_folder_is_one_line_before_anything_starts(monkeypatch, tmp_path):
    """A hosted server's read-only home: ``--keep`` says what to set before any process
    starts, and the listing (``%dp list``, the server's /api/dpnb/clusters) is empty, not
    an error.  (Root writes anywhere: a file stands where the home's folders would go.)"""
    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(keep.STATE_ENV, raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setattr("dpnb.cluster.launch.bring_up",
                        lambda *a, **k: pytest.fail("engines started before the refusal"))
    with pytest.raises(DpnbError, match="set DPNB_STATE_DIR to a writable folder") as e:
        dpnb.start(2, keep="1h", timeout=5)
    assert "\n" not in str(e.value) and str(home) in str(e.value)
    assert keep.kept() == []
    monkeypatch.setenv(keep.STATE_ENV, str(tmp_path / "kept"))
    assert keep.checked_ttl("1h") == 3600 and (tmp_path / "kept").is_dir()
