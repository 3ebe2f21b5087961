"""The owner's private folder and the compile caches that go in it."""

from __future__ import annotations

import os
import stat

from dpnb.engine.proc import private


def _mode(p: str) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_private_dir_is_made_0700_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(private.tempfile, "tempdir", None)  # re-read TMPDIR
    a = private.private_dir()
    assert a == str(tmp_path / f"dpnb-{os.getuid()}") and _mode(a) == 0o700
    assert private.private_dir() == a


def test_a_loose_folder_at_the_name_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(private.tempfile, "tempdir", None)
    planted = tmp_path / f"dpnb-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)  # what another user's folder of that name looks like to us
    got = private.private_dir()
    assert got != str(planted) and _mode(got) == 0o700


def test_caches_go_private_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(private.tempfile, "tempdir", None)
    # torch's own /tmp default, exported by a kernel that compiled: not a choice
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", private._torch_default("TORCHINDUCTOR_CACHE_DIR"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/data/my-triton")  # the user's choice
    got = private.private_caches()
    assert list(got) == ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(private.private_dir())
    assert os.environ["TRITON_CACHE_DIR"] == "/data/my-triton"


def test_a_0700_folder_at_the_name_owned_by_another_user_is_not_used(tmp_path, monkeypatch):
    """Mode alone is not ownership: another user's own 0700 folder at our name
    (made before us, so that we would write our sockets and caches into it)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(private.tempfile, "tempdir", None)
    me = os.getuid()
    if os.geteuid() != 0:  # we cannot give a folder away: be someone else instead
        me += 1
        monkeypatch.setattr(private.os, "getuid", lambda: me)
    planted = tmp_path / f"dpnb-{me}"
    planted.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # nobody's, as another user would have made it
    assert _mode(planted) == 0o700 and os.stat(planted).st_uid != me
    got = private.private_dir()
    assert got != str(planted) and _mode(got) == 0o700 and os.stat(got).st_uid == os.geteuid()
