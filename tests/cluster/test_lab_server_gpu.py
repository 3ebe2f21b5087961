"""The server's loop is never held by a GPU query: a real ``jupyter server`` with
dpnb's extension, a published cluster with a CUDA rank, and a stand-in
``nvidia-smi`` that takes 20 s.  Every request meanwhile -- the cluster list
itself, the server's own status -- is answered at once; the sidebar would
show GPU memory from the reading after it."""

import os
import time

import pytest
from helpers import labserver
from helpers.labrecords import _cuda_publication

from dpnb.cluster import publish

pytestmark = pytest.mark.cluster

def test_requests_are_answered_while_a_gpu_query_hangs(tmp_path, monkeypatch):
    bin_, calls = tmp_path / "bin", tmp_path / "calls"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\necho run >> {calls}\nsleep 20\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    with labserver.running(tmp_path / "srv") as srv:
        monkeypatch.setenv(publish.PUBLISH_ENV, srv.env[publish.PUBLISH_ENV])
        pub = _cuda_publication(os.getpid())  # this process stands in for the kernel
        try:
            took = {}
            for what in ("/api/dpnb/clusters", "/api/status", "/api/dpnb/clusters"):
                t0 = time.monotonic()
                status, body = srv.request(what)
                took[f"{len(took)} {what}"] = time.monotonic() - t0
                assert status == 200, body
                if what == "/api/dpnb/clusters":  # listed, without waiting for the GPU
                    assert [r["gpu_mb"] for r in body["clusters"][0]["ranks"]] == [None, None]
                time.sleep(0.5)
            assert calls.exists()  # the query did start, and hangs meanwhile
            assert max(took.values()) < 3.0, took  # not the 5 s nvidia-smi was allowed
        finally:
            pub.remove()
